"""Build table directories from checkpoints or from a seed, streaming (never the whole table in RAM). Sources:
safetensors shards with the DeepSeek-V4.1 names ``[model.]layers.L.engram.embed.weight`` (F8_E4M3 [rows, dim]) +
``...embed.scale`` (F8_E8M0 [rows, dim/32]), read lazily slice by slice (BF16/F16/F32 weights stay that dtype, or MXFP8
with ``quantize="mxfp8"``; any tensor by name); or synthetic tables from (rows, dim, seed) whose bytes depend only on
the arguments (valid E4M3, no NaN; scale bytes in [118, 125])."""
from __future__ import annotations

import collections
import concurrent.futures as cf
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from engram.quant import quantize_mxfp8
from engram.store.format import DEFAULT_CHUNK_BYTES, ITEMSIZE, SCALE_BLOCK, TableManifest
from engram.store.kernels.reference import ROW_TORCH_DTYPES
from engram.store.writer import IN_FLIGHT, TableWriter

V41_NAME = re.compile(r"^(?:model\.)?layers\.(\d+)\.engram\.embed\.(weight|scale)$")
SAFETENSORS_FLOAT_ROW_DTYPES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}  # safetensors dtype -> row dtype
CHUNK_TARGET_BYTES = 64 << 20  # values bytes generated / copied per step
RANDOM_CHUNK_BYTES = 16 << 20  # value bytes per random chunk (each has its own seeded generator)
RANDOM_SCALE_LO = 118  # random scale bytes are in [118, 125]: factors 2**-9 .. 2**-2


def layer_dir(out_dir: str | os.PathLike, layer_id: int) -> Path:
    """Where ``convert`` puts layer ``layer_id``'s table: OUT/layer_<L>."""
    return Path(out_dir) / f"layer_{layer_id}"


def shard_paths(sources: Iterable[str | os.PathLike]) -> list[Path]:
    """Expand files and directories (every *.safetensors inside) into a sorted list of shard files."""
    out: list[Path] = []
    for s in sources:
        p = Path(s)
        if p.is_dir():
            out += sorted(p.glob("*.safetensors"))
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"safetensors source {p} does not exist")
    if not out:
        raise FileNotFoundError(f"no *.safetensors files in {[str(s) for s in sources]}")
    return out


@dataclass
class _Source:
    """Where one tensor lives."""

    path: Path  # shard file
    name: str  # tensor name inside it


def find_engram_tensors(shards: list[Path]) -> dict[int, dict[str, _Source]]:
    """{layer: {"weight": src, "scale": src}} over all shards, by the V4.1 names."""
    from safetensors import safe_open

    found: dict[int, dict[str, _Source]] = {}
    for path in shards:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                match = V41_NAME.match(name)
                if match:
                    layer, kind = int(match.group(1)), match.group(2)
                    if kind in found.setdefault(layer, {}):
                        other = found[layer][kind]
                        raise ValueError(f"layer {layer} {kind} appears twice: {other.path}:{other.name} and "
                                         f"{path}:{name}")
                    found[layer][kind] = _Source(path, name)
    return found


def find_tensor(shards: list[Path], name: str) -> _Source:
    """The first shard holding a tensor called ``name``; ValueError when none does."""
    from safetensors import safe_open

    for path in shards:
        with safe_open(str(path), framework="pt") as f:
            if name in f.keys():
                return _Source(path, name)
    raise ValueError(f"tensor {name!r} is in none of {[str(p) for p in shards]}")


def _chunk_rows(row_bytes: int) -> int:
    return max(1, CHUNK_TARGET_BYTES // max(1, row_bytes))


def _fingerprint(config: Any, layer_id: int | None, rows: int, dim: int) -> dict[str, Any] | None:
    """The layout fingerprint for a table of ``config``'s layer, after checking rows and dim fit it."""
    if config is None or layer_id is None:
        return None
    if layer_id not in config.layer_ids:
        raise ValueError(f"layer {layer_id} is not an Engram layer of the config (layer_ids={config.layer_ids})")
    want_rows = config.table_rows(layer_id)
    if rows != want_rows or dim != config.head_dim:
        raise ValueError(f"layer {layer_id}: tensor is [{rows}, {dim}] but the config's layout needs "
                         f"[{want_rows}, {config.head_dim}] (table_rows, head_dim)")
    return config.fingerprint(layer_id)


def convert_tensor(weight: _Source, out: str | os.PathLike, *, scale: _Source | None = None,
                   layer_id: int | None = None, quantize: str | None = None, config: Any = None,
                   progress: bool = True, chunk_bytes: int | None = None) -> TableManifest:
    """One table from a weight tensor (and its MXFP8 scale tensor), streamed slice by slice."""
    from safetensors import safe_open

    with safe_open(str(weight.path), framework="pt") as fw:
        wsl = fw.get_slice(weight.name)
        shape = wsl.get_shape()
        if len(shape) != 2:
            raise ValueError(f"{weight.path}:{weight.name} has shape {shape}, expected 2-D [rows, dim]")
        rows, dim = shape
        wdtype = wsl.get_dtype()
        fp8 = wdtype == "F8_E4M3"
        if fp8 and scale is None:
            raise ValueError(f"{weight.path}:{weight.name} is F8_E4M3 but has no scale tensor "
                             f"({weight.name.rsplit('.', 1)[0]}.scale)")
        if not fp8 and wdtype not in SAFETENSORS_FLOAT_ROW_DTYPES:
            raise ValueError(f"{weight.path}:{weight.name} has dtype {wdtype}; expected F8_E4M3, BF16, F16 or F32")
        if quantize not in (None, "mxfp8"):
            raise ValueError(f"quantize={quantize!r} must be None or 'mxfp8'")
        row_dtype = "mxfp8" if (fp8 or quantize == "mxfp8") else SAFETENSORS_FLOAT_ROW_DTYPES[wdtype]
        meta = {"source": f"{weight.path.name}:{weight.name}", "source_dtype": wdtype}
        if quantize and not fp8:
            meta["quantized"] = "mxfp8"
        step = _chunk_rows(dim * (1 if fp8 else 4))
        with TableWriter(out, rows, dim, row_dtype, layer_id=layer_id,
                         fingerprint=_fingerprint(config, layer_id, rows, dim), meta=meta, progress=progress,
                         desc=Path(out).name, chunk_bytes=chunk_bytes or DEFAULT_CHUNK_BYTES) as w:
            if fp8:
                with safe_open(str(scale.path), framework="pt") as fs:
                    ssl = fs.get_slice(scale.name)
                    if list(ssl.get_shape()) != [rows, dim // SCALE_BLOCK] or ssl.get_dtype() not in ("F8_E8M0", "U8"):
                        raise ValueError(f"{scale.path}:{scale.name} is {ssl.get_dtype()} {ssl.get_shape()}, "
                                         f"expected F8_E8M0 [{rows}, {dim // SCALE_BLOCK}]")
                    for a in range(0, rows, step):
                        b = min(rows, a + step)
                        w.append(wsl[a:b], ssl[a:b])  # [b-a, dim] fp8, [b-a, dim/32] e8m0
            else:
                for a in range(0, rows, step):
                    b = min(rows, a + step)
                    chunk = wsl[a:b]  # [b-a, dim] bf16 / fp16 / fp32
                    if row_dtype == "mxfp8":
                        w.append(*quantize_mxfp8(chunk))  # per-row blocks: chunking cannot change the bytes
                    else:
                        w.append(chunk)
            return w.finish()


def convert_safetensors(sources: Iterable[str | os.PathLike], out_dir: str | os.PathLike, *,
                        layers: Iterable[int] | None = None, quantize: str | None = None, config: Any = None,
                        progress: bool = True, chunk_bytes: int | None = None) -> list[TableManifest]:
    """One table per Engram layer found under the V4.1 names, written to OUT/layer_<L>."""
    shards = shard_paths(sources)
    found = find_engram_tensors(shards)
    if not found:
        raise ValueError(f"no tensors named [model.]layers.L.engram.embed.weight in {[str(p) for p in shards]}")
    wanted = sorted(found) if layers is None else sorted(set(layers))
    missing = [lid for lid in wanted if lid not in found]
    if missing:
        raise ValueError(f"layers {missing} have no engram.embed tensors (found layers {sorted(found)})")
    out = []
    for lid in wanted:
        if "weight" not in found[lid]:
            raise ValueError(f"layer {lid} has an engram.embed.scale but no engram.embed.weight")
        out.append(convert_tensor(found[lid]["weight"], layer_dir(out_dir, lid), scale=found[lid].get("scale"),
                                  layer_id=lid, quantize=quantize, config=config, progress=progress,
                                  chunk_bytes=chunk_bytes))
    return out


def random_chunk_rows(dim: int, row_dtype: str) -> int:
    """Rows per chunk of a random table: RANDOM_CHUNK_BYTES of values, each chunk its own generator."""
    return max(1, RANDOM_CHUNK_BYTES // (dim * ITEMSIZE[row_dtype]))


def random_chunk_buffers(rows: int, dim: int) -> tuple[torch.Tensor, ...]:
    """Scratch ``random_chunk`` reuses for one MXFP8 chunk at a time (fresh ones would page-fault every chunk)."""
    words = min(rows, random_chunk_rows(dim, "mxfp8")) * dim // 8
    return (torch.empty(words, dtype=torch.int64), torch.empty(words // 4 + 1, dtype=torch.int64),
            torch.empty(words, dtype=torch.int64))


def random_chunk(seed: int, k: int, n: int, dim: int, row_dtype: str, buf: tuple[torch.Tensor, ...] | None):
    """Chunk ``k`` (``n`` rows) of ``seed``'s random table from its own generator (MXFP8: (values, scales) in ``buf``;
    else (values,)); shared with in-memory tables (model/tables.py), so both hold the same bytes."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + k) % (1 << 63))  # chunk k's own stream
    if row_dtype == "mxfp8":
        return _random_mxfp8(n, dim, gen, buf)
    return (torch.randn(n, dim, generator=gen).mul_(0.05).to(ROW_TORCH_DTYPES[row_dtype]),)


def _random_mxfp8(n: int, dim: int, gen: torch.Generator,
                  buf: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """n random MXFP8 rows in ``buf`` -> (E4M3 bytes [n, dim] without NaN, scale bytes [n, dim/32] in [118, 125])."""
    words, sw, t = buf[0][: n * dim // 8], buf[1][: n * dim // SCALE_BLOCK // 8 + 1], buf[2][: n * dim // 8]
    words.random_(-(1 << 63), None, generator=gen)  # every bit uniform
    # Byte b is a NaN encoding when b & 0x7f == 0x7f: adding 1 to its low 7 bits then carries into bit 7.
    torch.bitwise_and(words, 0x7F7F7F7F7F7F7F7F, out=t).add_(0x0101010101010101)
    t.bitwise_and_(0x8080808080808080 - (1 << 64)).bitwise_right_shift_(7)
    words.bitwise_xor_(t)  # NaN bytes become 0x7e / 0xfe (the top byte of a word: 0x80 / 0x00)
    sw.random_(0, 1 << 62, generator=gen).bitwise_and_(0x0707070707070707)
    sw.add_(RANDOM_SCALE_LO * 0x0101010101010101)  # every byte in [118, 125]
    scales = sw.view(torch.uint8)[: n * dim // SCALE_BLOCK].view(n, dim // SCALE_BLOCK)
    return words.view(torch.uint8).view(n, dim), scales


def convert_random(out: str | os.PathLike, rows: int, dim: int, seed: int = 0, row_dtype: str = "mxfp8", *,
                   layer_id: int | None = None, config: Any = None, progress: bool = True,
                   chunk_bytes: int | None = None, workers: int | None = None) -> TableManifest:
    """A synthetic table whose bytes depend only on (rows, dim, seed, row_dtype): each chunk has its own generator,
    ``workers`` generate ahead into a ring of IN_FLIGHT + workers + 1 buffers while the writer writes in order."""
    if row_dtype == "mxfp8" and dim % SCALE_BLOCK:
        raise ValueError(f"dim={dim} must be a multiple of {SCALE_BLOCK} for mxfp8 rows")
    if row_dtype not in ITEMSIZE:
        raise ValueError(f"row_dtype={row_dtype!r} must be one of mxfp8, bf16, fp16, fp32")
    step = random_chunk_rows(dim, row_dtype)
    starts = list(range(0, rows, step))
    workers = max(1, min(workers or min(4, os.cpu_count() or 1), len(starts)))
    ring = ([random_chunk_buffers(rows, dim) for _ in range(IN_FLIGHT + workers + 1)]
            if row_dtype == "mxfp8" else [None])

    def make(k: int):
        n = min(rows, starts[k] + step) - starts[k]
        return random_chunk(seed, k, n, dim, row_dtype, ring[k % len(ring)])

    meta = {"source": "random", "seed": seed}
    with TableWriter(out, rows, dim, row_dtype, layer_id=layer_id,
                     fingerprint=_fingerprint(config, layer_id, rows, dim),
                     meta=meta, progress=progress, desc=Path(out).name,
                     chunk_bytes=chunk_bytes or DEFAULT_CHUNK_BYTES) as w, \
            cf.ThreadPoolExecutor(workers, thread_name_prefix="engram-random") as pool:
        pending: collections.deque = collections.deque()
        nxt = 0
        for _ in starts:
            while nxt < len(starts) and len(pending) < workers:  # at most `workers` chunks generated ahead
                pending.append(pool.submit(make, nxt))
                nxt += 1
            w.append(*pending.popleft().result())
        return w.finish()
