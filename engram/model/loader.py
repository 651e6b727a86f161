"""load_model / save_model: a preset or an HF-style checkpoint directory (``config.json``, ``*.safetensors``,
``tokenizer.json``) -> a ready LoadedModel. Tables are converted once into the cache directory (tables.py) and opened by
the Worker (``LoadedModel.open_tables``). Pickled weights are refused; errors name tensor and shapes."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engram.config import EngramConfig, hf_text_config, parse_json_object
from engram.model.decoder import EngramDecoder, LayerGap, keep_layers
from engram.model.deepseek_v4.checkpoint import load_v4_weights
from engram.model.deepseek_v4.config import ARCHITECTURES as V4_ARCHITECTURES, V4Config
from engram.model.deepseek_v4.decoder import DeepseekV4Model
from engram.model.model_config import ModelConfig
from engram.model.presets import (HOST_INIT_MAX_PARAMS, MODEL_PRESETS, TOKENIZER_FILE, init_random_weights,
                                  preset_config, random_v4_model)
from engram.model.tables import (checkpoint_table_dirs, convert_checkpoint_tables, ensure_preset_tables,
                                 open_random_tables, open_tables)
from engram.weights import V41_TABLE_KEYS
from engram.model.options import RuntimeOptions
from engram.model.tables import read_table_tensors
from engram.tokenizer import CompressedTokenizer
from engram.weights import load_engram_weights

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float64": torch.float64, "fp64": torch.float64,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
ENGRAM_TABLE_KEYS = tuple(f"engram.{k}" for k in V41_TABLE_KEYS)  # converted into the store, not loaded


@dataclass
class LoadedModel:
    model: EngramDecoder | DeepseekV4Model  # on ``device`` in ``dtype``, eval mode, no grads
    model_config: ModelConfig | V4Config
    engram_config: EngramConfig | None
    tokenizer: Any  # tokenizers.Tokenizer
    compressed_tokenizer: Any  # engram.tokenizer.CompressedTokenizer
    tables: dict[int, Any]  # Engram layer id -> opened store table; {} until open_tables() (or given opened)
    eos_token_id: int | None
    chat_template: str | None
    name: str
    table_dirs: dict[int, Path] = field(default_factory=dict)  # layer id -> table directory in the cache
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    tier: str = "gpu"  # where open_tables() puts the tables: "gpu" | "host" | "disk"
    store_options: Any = None  # engram.store.StoreOptions for open_tables() (None: the defaults)
    memory_table_seed: int | None = None  # tables_in_memory: the preset seed open_tables() builds them from
    lookup_overlap: bool = True  # the Worker gathers Engram rows on a lookup stream (CUDA; engine/lookup_stream.py)
    layers: range | None = None  # the decoder layers built (a pipeline stage's); None: all

    @property
    def table_layer_ids(self) -> tuple[int, ...]:
        """The Engram layers whose tables this model opens: those of the layers it holds."""
        if self.engram_config is None:
            return ()
        return tuple(l for l in self.engram_config.layer_ids if self.layers is None or l in self.layers)

    def open_tables(self) -> dict[int, Any]:
        """The tables, opened on ``tier`` and ``device`` at the first call (from ``table_dirs``, or built in memory with
        ``memory_table_seed``); tables passed in opened are kept."""
        if self.tables or self.engram_config is None:
            return self.tables
        options = self.store_options.to_dict() if self.store_options is not None else None
        if self.memory_table_seed is not None:
            self.tables = open_random_tables(self.engram_config, self.memory_table_seed, self.tier, self.device,
                                             options, layers=self.table_layer_ids)
        elif self.table_dirs:
            self.tables = open_tables({l: self.table_dirs[l] for l in self.table_layer_ids}, self.engram_config,
                                      self.tier, self.device, options)
        return self.tables


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """None -> bfloat16 on CUDA, float32 elsewhere; names as in DTYPES."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def build_model(cfg: ModelConfig | V4Config, dtype: torch.dtype, device: torch.device,
                layers: range | None = None) -> EngramDecoder | DeepseekV4Model:
    """A model built on ``device`` (float32, cast to ``dtype``) with placeholder values until weights are loaded; a
    DeepSeek-V4 model keeps its float32 pieces float32. ``layers``: build only these decoder layers
    (``decoder.keep_layers``: made on the meta device, then only the kept modules on ``device``)."""
    if layers is not None and isinstance(cfg, V4Config):
        raise NotImplementedError(f"layers={layers}: a deepseek_v4 model is built whole (no pipeline stages)")
    if layers is None:
        with torch.device(device):
            model = DeepseekV4Model(cfg) if isinstance(cfg, V4Config) else EngramDecoder(cfg)
    else:
        with torch.device("meta"):
            model = keep_layers(EngramDecoder(cfg), layers)
        model = model.to_empty(device=device)
    model = model.to(dtype)
    if isinstance(model, DeepseekV4Model):
        model.keep_fp32()
    else:
        model.tie_weights()
    return model.eval().requires_grad_(False)


def load_model(model: str | os.PathLike = "tiny", tier: str = "gpu", dtype: str | torch.dtype | None = None,
               device: str | torch.device | None = None, engram_config=None,
               cache_dir: str | os.PathLike | None = None, progress: bool = True,
               layers: range | None = None) -> LoadedModel:
    """Load a preset (``MODEL_PRESETS``) or a checkpoint directory; ``engram_config``: a dict or
    RuntimeOptions (model/options.py). ``layers``: only these decoder layers' weights are built and loaded, and only
    their Engram layers' tables opened (a pipeline stage's; None: all)."""
    opts = engram_config if isinstance(engram_config, RuntimeOptions) else RuntimeOptions.from_dict(engram_config)
    tier = opts.tier(tier)
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dt = resolve_dtype(dtype, dev)
    name = os.fspath(model)
    if name in MODEL_PRESETS:
        return _load_preset(name, tier, dt, dev, opts, cache_dir, progress, layers)
    path = Path(name)
    if path.is_file() and path.suffix in PICKLE_SUFFIXES:
        raise ValueError(f"{path}: pickled checkpoints are not loaded (unpickling runs code); convert it to "
                         f"safetensors (safetensors.torch.save_file) in an HF-style directory")
    if not path.is_dir():
        raise ValueError(f"model={name!r} is neither a preset {MODEL_PRESETS} nor a checkpoint directory")
    if opts.tables_in_memory:
        raise ValueError(f"engram_config.tables_in_memory=true builds a preset's random tables {MODEL_PRESETS}; "
                         f"{path} is a checkpoint directory, whose tables are converted from its safetensors "
                         "into table files")
    return _load_checkpoint(path, tier, dt, dev, opts, cache_dir, progress, layers)


def _tokenizers(path: Path):
    from tokenizers import Tokenizer


    if not path.is_file():
        raise ValueError(f"{path}: tokenizer.json not found (a checkpoint needs one)")
    return Tokenizer.from_file(str(path)), CompressedTokenizer.from_file(path)


def _load_preset(name, tier, dtype, device, opts, cache_dir, progress, layers=None) -> LoadedModel:
    seed = opts.seed
    cfg = preset_config(name, table_rows=opts.table_rows, seed=seed)
    return random_model(cfg, tier, dtype, device, seed, cache_dir, opts, progress, layers)


def random_model(cfg: ModelConfig | V4Config, tier: str = "gpu", dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", seed: int = 0, cache_dir=None, opts=None,
                 progress: bool = True, layers: range | None = None) -> LoadedModel:
    """Any ModelConfig or V4Config with deterministic random weights and tables, built-in tokenizer (``opts``:
    RuntimeOptions); ``layers``: only these decoder layers (their weights are the whole model's, drawn where the whole
    model's are; a V4 model is built whole). A V4 model is made empty in ``dtype`` on ``device`` and filled there
    (presets.random_v4_model)."""
    in_memory = opts is not None and opts.tables_in_memory
    if in_memory:
        opts.tier(tier)  # tier "disk" is refused before anything is built
    device = torch.device(device)
    if isinstance(cfg, V4Config):
        if layers is not None:
            raise NotImplementedError(f"layers={layers}: a deepseek_v4 model is built whole (no pipeline stages)")
        model = random_v4_model(cfg, dtype, device, seed)
    else:
        model = build_model(cfg, dtype, device, layers)
        init_random_weights(model, seed, on_device=None if layers is None else draws_on_device(cfg))
    tok, ctok = _tokenizers(TOKENIZER_FILE)
    dirs = {}
    if cfg.engram is not None and not in_memory:
        dirs = ensure_preset_tables(cfg.engram, seed, cache_dir, progress=progress)
    return LoadedModel(model, cfg, cfg.engram, tok, ctok, {}, cfg.eos_token_id, cfg.chat_template, cfg.name,
                       dirs, dtype, device, tier, opts.store if opts is not None else None,
                       memory_table_seed=seed if in_memory and cfg.engram is not None else None,
                       lookup_overlap=opts.lookup_overlap if opts is not None else True, layers=layers)


# ----------------------------------------------------------------- checkpoints
def _canonical(key: str) -> str:
    """Checkpoint key -> this model's parameter name (adds the ``model.`` prefix where HF omits it)."""
    return key if key.startswith(("model.", "lm_head.")) else f"model.{key}"


def _safetensors_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickled:
            raise ValueError(f"{path}: only pickled weights {pickled} found; they are not loaded (unpickling runs "
                             f"code). Convert them to safetensors (safetensors.torch.save_file) first")
        raise ValueError(f"{path}: no *.safetensors weights found")
    return files


def _read_json(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    return parse_json_object(text, str(path))


def draws_on_device(cfg: ModelConfig) -> bool:
    """Whether the whole model's random weights are drawn on the device (``init_random_weights``' default), counted
    on the meta device: a model of some of its layers draws its weights where the whole model does."""
    with torch.device("meta"):
        return sum(p.numel() for p in EngramDecoder(cfg).parameters()) > HOST_INIT_MAX_PARAMS


def model_size(cfg, dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """What a model of ``cfg`` (a V4Config or a dense ModelConfig) holds when built in ``dtype``, counted on the meta
    device (nothing allocated): ``parameters`` and their ``parameter_bytes`` (a tied head counted once; V4's float32
    pieces at 4 bytes), ``buffer_bytes`` (V4: ``tid2eid`` and router biases), ``routed_expert_parameters`` (V4's
    stacks), ``engram_parameters`` (the Engram modules, in the parameters) and ``table_bytes`` (every Engram layer's
    table as stored, outside the model)."""
    with torch.device("meta"):
        model = DeepseekV4Model(cfg) if isinstance(cfg, V4Config) else EngramDecoder(cfg)
        model = model.to(dtype)
    if isinstance(model, DeepseekV4Model):
        model.keep_fp32()
    else:
        model.tie_weights()
    params = dict(model.named_parameters())  # one entry per tensor: a tied head is listed once
    e = cfg.engram
    return {
        "parameters": sum(p.numel() for p in params.values()),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in params.values()),
        "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
        "routed_expert_parameters": sum(p.numel() for n, p in params.items() if n.endswith(("experts.w13",
                                                                                            "experts.w2"))),
        "engram_parameters": sum(p.numel() for n, p in params.items() if ".engram." in n),
        "table_bytes": 0 if e is None else sum(e.table_bytes(lid) for lid in e.layer_ids),
    }


def _held(model: EngramDecoder, name: str) -> bool:
    """Whether ``model`` holds the parameter called ``name`` (False: a layer or head another stage holds)."""
    parts = name.split(".")
    if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit():
        i = int(parts[2])  # a layer past the config's is unexpected: reported as such by the caller
        return i >= len(model.model.layers) or not isinstance(model.model.layers[i], LayerGap)
    module = {"model.embed_tokens": model.model.embed_tokens, "model.norm": model.model.norm,
              "lm_head": model.lm_head}.get(name.rpartition(".")[0], model)
    return module is not None


@torch.no_grad()
def _load_weights(model: EngramDecoder, files: list[Path]) -> None:
    """Copy every decoder/Engram tensor ``model`` holds into it (not the tables); ValueError naming a bad or missing
    tensor. Tensors of layers another pipeline stage holds are skipped."""
    from safetensors import safe_open


    cfg = model.config
    params = dict(model.named_parameters())  # a tied lm_head is listed once (as the embedding)
    engram_layers = model.engram_layers
    engram_sd: dict[int, dict[str, torch.Tensor]] = {l: {} for l in engram_layers}
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                name = _canonical(key)
                if not _held(model, name):
                    continue
                parts = name.split(".")
                if len(parts) > 4 and parts[3] == "engram" and parts[2].isdigit():
                    lid = int(parts[2])
                    if lid not in engram_layers:
                        unexpected.append(key)
                    elif not name.endswith(ENGRAM_TABLE_KEYS):
                        engram_sd[lid][name] = f.get_tensor(key)
                    continue
                if name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue  # tied: the embedding is the head
                if name not in params:
                    unexpected.append(key)
                    continue
                p, t = params[name], f.get_tensor(key)
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"{file.name}: tensor {key!r} has shape {list(t.shape)}, expected "
                                     f"{list(p.shape)} (from config.json)")
                p.copy_(t.to(p.dtype))
                loaded.add(name)
    if unexpected:
        raise ValueError(f"checkpoint has unexpected tensors (not in the {cfg.architecture} layout of "
                         f"config.json): {sorted(unexpected)[:8]}{' ...' if len(unexpected) > 8 else ''}")
    for lid, layer in engram_layers.items():
        prefix = f"model.layers.{lid}.engram."
        load_engram_weights(layer, engram_sd[lid], prefix=prefix)  # every parameter, or ValueError
        loaded.update(prefix + pname for pname, _ in layer.named_parameters())
    missing = sorted(n for n in params if n not in loaded)
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {missing[:8]}{' ...' if len(missing) > 8 else ''}")


def _load_v4(cfg: V4Config, files: list[Path], dtype, device) -> DeepseekV4Model:
    model = build_model(cfg, dtype, device)
    engram = load_v4_weights(model, files, ENGRAM_TABLE_KEYS)
    for lid, layer in model.engram_layers.items():
        load_engram_weights(layer, engram[lid], prefix=f"model.layers.{lid}.engram.")
    return model


def _load_checkpoint(path: Path, tier, dtype, device, opts, cache_dir, progress, layers=None) -> LoadedModel:
    raw = _read_json(path / "config.json")
    if not raw:
        raise ValueError(f"{path}: config.json not found or empty")
    tok_cfg = _read_json(path / "tokenizer_config.json")
    v4 = hf_text_config(raw).get("model_type") in V4_ARCHITECTURES  # the one dispatch on model_type
    cfg = (V4Config if v4 else ModelConfig).from_hf_dict(raw, name=path.name)  # config errors before file errors
    cfg = cfg.replace(chat_template=tok_cfg.get("chat_template"))
    files = _safetensors_files(path)
    if v4:
        model = _load_v4(cfg, files, dtype, device)
    else:
        model = build_model(cfg, dtype, device, layers)
        _load_weights(model, files)
    tok, ctok = _tokenizers(path / "tokenizer.json")
    dirs = {}
    if cfg.engram is not None:
        ctok.check_config(cfg.engram)
        dirs = checkpoint_table_dirs(path, cfg.engram, cache_dir)
        convert_checkpoint_tables(path, dirs, cfg.engram, progress=progress)
    return LoadedModel(model, cfg, cfg.engram, tok, ctok, {}, cfg.eos_token_id, cfg.chat_template, cfg.name,
                       dirs, dtype, device, tier, opts.store if opts is not None else None,
                       lookup_overlap=opts.lookup_overlap if opts is not None else True, layers=layers)


# ----------------------------------------------------------------- save
def save_model(directory: str | os.PathLike, loaded: LoadedModel, dtype: torch.dtype | None = None) -> Path:
    """Write ``loaded`` as a checkpoint load_model reads back (config, safetensors with the tables as ``embed.weight`` /
    ``embed.scale``, tokenizer files); tables built in memory have no files and are refused."""
    from safetensors.torch import save_file

    if isinstance(loaded.model_config, V4Config):
        raise NotImplementedError(f"{loaded.name}: save_model writes Llama / Qwen checkpoints; a deepseek_v4 "
                                  "checkpoint is written by transformers' save_pretrained")
    if loaded.memory_table_seed is not None:
        raise ValueError(f"{loaded.name}: its tables were built in memory (engram_config.tables_in_memory) and "
                         "have no files to save; load it without tables_in_memory to save it")

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    cfg = loaded.model_config
    tensors: dict[str, torch.Tensor] = {}
    for name, p in loaded.model.named_parameters():  # tied lm_head appears once
        t = p.detach().to("cpu")
        tensors[name] = (t.to(dtype) if dtype is not None else t).contiguous()
    for lid, d in loaded.table_dirs.items():
        values, scales = read_table_tensors(d)
        tensors[f"model.layers.{lid}.engram.embed.weight"] = values
        if scales is not None:
            tensors[f"model.layers.{lid}.engram.embed.scale"] = scales
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=1) + "\n")
    loaded.tokenizer.save(str(out / "tokenizer.json"))
    tok_cfg = {"chat_template": cfg.chat_template} if cfg.chat_template else {}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1) + "\n")
    return out
