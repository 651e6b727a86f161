"""``engram.LLM``: load a model (preset or checkpoint) and generate, vLLM style.
``LLM(model, tier, dtype, engram_config, **engine_options)`` loads through ``load_model`` and builds an LLMEngine;
``generate`` returns RequestOutputs in prompt order. ``engram_config``: ``--engram-config`` keys (model/options.py)."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Iterable

import torch

from engram.engine.config import EngineConfig
from engram.engine.data_parallel import data_parallel_engine
from engram.engine.engine import LLMEngine
from engram.engine.multiproc import MultiprocExecutor, free_port
from engram.engine.tp_rank import make_rank_spec
from engram.engine.torchrun import TorchrunExecutor, torchrun_rank
from engram.model.deepseek_v4.config import ARCHITECTURES as SEQUENCE_CACHE_ARCHITECTURES
from engram.model.options import RuntimeOptions
from engram.engine.outputs import RequestOutput
from engram.engine.sampling_params import SamplingParams
from engram.model.loader import load_model, resolve_dtype
from engram.parallel import tp
from engram.parallel.pp import PipelinePlan, local_allocation, model_plan

class LLM:
    def __init__(self, model: str = "tiny", tier: str = "gpu", dtype: str | torch.dtype | None = None,
                 engram_config: dict[str, Any] | None = None, device: str | torch.device | None = None,
                 cache_dir: str | None = None, **engine_options: Any):
        engine_config = EngineConfig.from_options(engine_options)  # bad options fail before loading
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(dtype, self.device)
        pp = engine_config.pipeline_parallel_size
        n = engine_config.tensor_parallel_size * pp
        if n > 1 and self.device.type == "cuda" and torch_ranks_missing(n):  # before anything loads
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size={n} on CUDA needs {n} GPUs (one a "
                             f"rank); this node has {torch.cuda.device_count()}")
        self.options = RuntimeOptions.from_dict(engram_config)  # bad keys fail before loading
        self.tier = self.options.tier(tier)
        if engine_config.data_parallel_size > 1:  # replicas in processes of their own; this one routes
            if torchrun_rank() is not None:
                raise ValueError(f"data_parallel_size={engine_config.data_parallel_size}: the replicas are spawned on "
                                 "this node; run it without torchrun")
            self.loaded = load_model(model, tier=self.tier, dtype=self.dtype, device="cpu", engram_config=self.options,
                                     cache_dir=cache_dir)
            self.engine = data_parallel_engine(str(model), self.tier, dtype, engram_config, self.device, cache_dir,
                                               engine_config, self.loaded.tokenizer, replica_llm)
            self._request_ids = itertools.count()
            return
        plan = None
        if pp > 1 and engine_config.data_parallel_size == 1:  # the planner's verdict, before any weight or table loads
            if torchrun_rank() is not None:
                raise NotImplementedError(f"pipeline_parallel_size={pp} under torchrun: pipeline stages run as "
                                          "spawned processes on one node; run it without torchrun")
            plan = model_plan(str(model), pp, table_rows=self.options.table_rows)
        # with ranks, this process needs the config and tokenizers only: its copy of the weights stays in RAM
        self.loaded = load_model(model, tier=self.tier, dtype=self.dtype, device=self.device if n == 1 else "cpu",
                                 engram_config=self.options, cache_dir=cache_dir)
        executor = None
        if n > 1 and self.loaded.model_config.architecture in SEQUENCE_CACHE_ARCHITECTURES:
            sizes = f"tensor_parallel_size={engine_config.tensor_parallel_size}" + (
                f", pipeline_parallel_size={pp}" if pp > 1 else "")
            raise NotImplementedError(f"{sizes}: {self.loaded.model_config.architecture} runs on one device "
                                      "(engram/parallel has no layout for its MoE and compressed attention)")
        if n > 1:
            executor = _parallel(model, self, engine_config, cache_dir, plan)
        self.engine = LLMEngine(self.loaded, engine_config, self.device, self.dtype, executor=executor)
        self._request_ids = itertools.count()

    def get_tokenizer(self):
        return self.loaded.tokenizer

    def generate(self, prompts: str | list[int] | Iterable[str | list[int] | dict],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt (text, token-id list, or {"prompt_token_ids": [...]}) to completion; outputs in order."""
        items = _as_prompt_list(prompts)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(items):
                raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(items)} prompts")
            params = sampling_params
        else:
            params = [sampling_params or SamplingParams()] * len(items)
        from tqdm.auto import tqdm

        ids = [f"gen-{next(self._request_ids)}" for _ in items]
        # n > 1: n independent engine requests per prompt (choice j seeded seed + j), merged afterwards
        children = {rid: [f"{rid}-{j}" for j in range(p.n)] if p.n > 1 else [rid] for rid, p in zip(ids, params)}
        done: dict[str, RequestOutput] = {}
        try:
            for rid, prompt, p in zip(ids, items, params):
                for j, child in enumerate(children[rid]):
                    # only the finished output is kept: no per-step copy of the output so far
                    choice = dataclasses.replace(p.for_choice(j), output_kind="final_only")
                    self.engine.add_request(child, prompt, choice)
            total = sum(len(c) for c in children.values())
            with tqdm(total=total, desc="generate", unit="req", disable=not use_tqdm) as bar:
                while self.engine.has_unfinished():
                    for out in self.engine.step():
                        if out.finished:
                            done[out.request_id] = out
                            bar.update(1)
        except BaseException:  # a bad prompt, a failed step, Ctrl-C: nothing of this call stays queued
            for child in (c for cs in children.values() for c in cs):
                self.engine.abort_request(child)
            raise
        return [_merge(rid, [done[c] for c in children[rid]]) for rid in ids]


def replica_llm(spec) -> "LLM":
    """A data-parallel replica's LLM (engine/dp_replica.py ReplicaSpec: the caller's arguments, data parallel 1)."""
    return LLM(spec.model, tier=spec.tier, dtype=spec.dtype, engram_config=spec.engram_config, device=spec.device,
               cache_dir=spec.cache_dir, **spec.engine_options)


def _parallel(model: str, llm: "LLM", config: EngineConfig, cache_dir: str | None, plan: PipelinePlan | None):
    """P x T Worker processes: spawned on this node (engine/multiproc.py; ``plan``: the pipeline's stages), or, for
    tensor parallelism alone, torchrun's (engine/torchrun.py: this process is rank 0, the others run ``serve_rank``);
    gloo on the CPU, NCCL (one GPU a rank) on CUDA."""
    tp.check_tp(llm.loaded.model_config, config.tensor_parallel_size)
    rank = torchrun_rank()
    if rank is None:
        stage_layers = None if plan is None else [local_allocation(plan, s).engram_layers for s in range(plan.pp)]
        spec = make_rank_spec(model, llm.tier, llm.dtype, llm.options, cache_dir, config,
                              f"tcp://127.0.0.1:{free_port()}", device=llm.device.type,
                              partition=None if plan is None else plan.partition)
        return MultiprocExecutor(spec, stage_layers)
    if rank != 0:
        raise ValueError(f"LLM(...) on torchrun rank {rank}: only rank 0 runs the engine; the other ranks run "
                         "engram.engine.torchrun.serve_rank (engram generate / serve do it)")
    return TorchrunExecutor(make_rank_spec(model, llm.tier, llm.dtype, llm.options, cache_dir, config, "env://",
                                           device=llm.device.type))


def torch_ranks_missing(n: int) -> bool:
    """Whether this node has fewer than ``n`` GPUs (spawned ranks take one each; torchrun's count across nodes)."""
    return torchrun_rank() is None and torch.cuda.device_count() < n


def _merge(request_id: str, outs: list[RequestOutput]) -> RequestOutput:
    """One RequestOutput with the choices' completions as outputs[j] (index j)."""
    if len(outs) == 1:
        return outs[0]
    completions = [dataclasses.replace(o.outputs[0], index=j) for j, o in enumerate(outs)]
    return dataclasses.replace(outs[0], request_id=request_id, outputs=completions)


def _as_prompt_list(prompts) -> list[str | list[int]]:
    if isinstance(prompts, str) or isinstance(prompts, dict):
        prompts = [prompts]
    elif isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
        prompts = [prompts]
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                p = list(p["prompt_token_ids"])
            elif "prompt" in p:
                p = p["prompt"]
            else:
                raise ValueError(f"prompt {i} is a dict without 'prompt' or 'prompt_token_ids'")
        if isinstance(p, torch.Tensor):
            p = p.tolist()
        if not isinstance(p, (str, list)):
            raise ValueError(f"prompt {i} must be text or a list of token ids, got {type(p).__name__}")
        out.append(p)
    return out
