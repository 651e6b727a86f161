"""Drive an LLMEngine to one measured point, and the settings every engine bench shares. ``measure_decode`` times
``steps`` engine steps in which each of B sequences emits exactly one token (``NotADecodeStep`` otherwise), after
prefill and ``warmup_tokens``; ``forced`` ids are emitted instead of the sampled ones (the step still samples); with
``busy_device``, ``profile_steps`` more run under torch.profiler. ``measure_prefill`` times steps that prefill S fresh
prompts whole. Every request is aborted at the end, also on error."""
from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, field

import torch

from engram.engine.sampling_params import SamplingParams

FIRST_ID = 3  # the built-in tokenizer's ids 0, 1, 2 are <|bos|>, <|eos|>, <|pad|>


class NotADecodeStep(AssertionError):
    """A timed decode step in which some sequence did not emit exactly one token (or finished)."""


class NotAPrefillStep(AssertionError):
    """A timed prefill step that did not prefill every prompt whole."""


def prompt_ids(num_seqs: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``num_seqs`` prompts of ``length`` ids uniform in [3, vocab_size), seeded with ``seed``."""
    if vocab_size <= FIRST_ID + 1:
        raise ValueError(f"vocab_size={vocab_size} leaves no ordinary token ids")
    g = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_ID, vocab_size, (num_seqs, length), generator=g).tolist()


def decode_max_tokens(batch: int, context_len: int, max_num_batched_tokens: int, warmup_tokens: int,
                      steps: int, profile_steps: int) -> int:
    """Tokens a decode request may generate: prefill-time steps, warm-up, timed and profiled steps, plus 2."""
    prefill_steps = math.ceil(batch * context_len / max_num_batched_tokens) + 1
    return prefill_steps + warmup_tokens + steps + profile_steps + 2


@dataclass(frozen=True)
class Settings:
    """What every arm measures (parsed and validated options)."""

    batch_sizes: tuple[int, ...]
    context_len: int
    decode_steps: int
    warmup_tokens: int
    profile_steps: int
    prefill_shapes: tuple[tuple[int, int], ...]  # (sequences, tokens each)
    prefill_repeats: int
    max_num_batched_tokens: int
    seed: int
    enforce_eager: bool = False  # engine arms run every step eagerly (no decode CUDA graphs)
    kernels: int = 0  # largest kernels recorded per profiled decode point
    async_scheduling: bool | None = None  # engine arms: None = the engine's default (on for CUDA)


def parse_ints(text: str, option: str) -> tuple[int, ...]:
    """"1,8,64" -> (1, 8, 64); SystemExit naming ``option`` unless every value is an int >= 1."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"{option}: {text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise SystemExit(f"{option}: {text!r} needs at least one value, all >= 1")
    return values


def engine_config(s: Settings, max_position_embeddings: int, block_size: int = 16):
    """The EngineConfig every engine arm runs: the largest batch and prefill in one step, the longest decode."""
    from engram.engine.config import EngineConfig

    seqs = max(s.batch_sizes + tuple(n for n, _ in s.prefill_shapes))
    budget = max((s.max_num_batched_tokens, seqs) + tuple(n * t for n, t in s.prefill_shapes))
    decode_len = s.context_len + decode_max_tokens(max(s.batch_sizes), s.context_len, budget, s.warmup_tokens,
                                                   s.decode_steps, s.profile_steps)
    need = max((decode_len,) + tuple(t + 1 for _, t in s.prefill_shapes))
    if need > max_position_embeddings:
        raise SystemExit(f"sequences of {need} tokens (context, decode steps, prefill shapes) exceed the model's "
                         f"max_position_embeddings={max_position_embeddings}")
    max_model_len = min(-(-need // block_size) * block_size, max_position_embeddings)
    return EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                        block_size=block_size, seed=s.seed, enforce_eager=s.enforce_eager,
                        async_scheduling=s.async_scheduling)


def parse_engram_config(text: str | None, option: str = "--engram-config") -> dict:
    """A JSON object of ``--engram-config`` keys ({} when not given); SystemExit naming ``option``."""
    from engram.config import parse_json_object

    try:
        return parse_json_object(text, option) if text else {}
    except ValueError as e:
        raise SystemExit(str(e)) from None


def runtime_options(raw: dict, option: str):
    """``raw`` as RuntimeOptions (every key and combination validated); SystemExit naming ``option``."""
    from engram.model.options import RuntimeOptions

    try:
        return RuntimeOptions.from_dict(raw)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"{option}: {e}") from None


def free_memory(device) -> None:
    """Collect garbage and give cached device memory back (between arms: the next one allocates afresh)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass
class DecodeTimes:
    """Host-clock seconds of each timed decode step and each sequence's KV length after it."""

    wall_s: list[float]
    context_lens: list[list[int]]  # [steps][batch]: KV entries after the step (prompt + tokens computed)
    graph_steps: int = 0  # timed steps that replayed a CUDA graph (engine.stats()["graph_replays"])
    busy_s: float | None = None  # device busy seconds per profiled step (None: not profiled)
    kernels: list = field(default_factory=list)  # device_time.KernelTime of the profiled steps (all of them)
    busy_context_lens: list[list[int]] = field(default_factory=list)  # the same for the profiled steps
    token_ids: list[list[int]] = field(default_factory=list)  # [batch]: each sequence's generated ids at the end
    lookup_exposed_s: float = 0.0  # engine.stats()["lookup_exposed_s"] gained over the timed steps
    tables: tuple = ()  # (before, after): engine.stats()["tables"] right before and after the timed steps


@dataclass
class PrefillTimes:
    wall_s: list[float]  # host-clock seconds of each timed step
    busy_s: float | None = None  # device busy seconds of the profiled step


def _decode_step(engine, ids: list[str], generated: dict[str, int], context_len: int,
                 tokens: dict[str, list[int]] | None = None) -> list[int]:
    """One step that must decode every request in ``ids`` by one token -> each sequence's KV length after it."""
    ctx = [context_len + generated[rid] for rid in ids]  # the last sampled token is computed this step
    outs = engine.step()
    by_id = {o.request_id: o for o in outs}
    if len(outs) != len(ids) or set(by_id) != set(ids):
        raise NotADecodeStep(f"a decode step emitted tokens for {len(by_id)} of {len(ids)} sequences "
                             f"(missing: {sorted(set(ids) - set(by_id))[:4]}): some sequence was not decoding")
    for rid, out in by_id.items():
        comp = out.outputs[0]
        if len(comp.delta_token_ids) != 1 or len(comp.token_ids) != generated[rid] + 1 or out.finished:
            raise NotADecodeStep(f"request {rid}: {len(comp.delta_token_ids)} new tokens, {len(comp.token_ids)} "
                                 f"in all after {generated[rid]}, finished={out.finished}; expected one more, "
                                 f"not finished")
        generated[rid] += 1
        if tokens is not None:
            tokens[rid] = comp.token_ids  # a reference: copied once after the timed steps, not in them
    return ctx


def measure_decode(engine, prompts: list[list[int]], steps: int, warmup_tokens: int = 3,
                   profile_steps: int = 0, busy_device: str | None = None, tag: str = "decode",
                   forced: list[list[int]] | None = None, probe=None) -> DecodeTimes:
    """Time ``steps`` pure decode steps of ``len(prompts)`` sequences; ``forced``: ids each request emits instead;
    ``probe(step)``, after the timed and profiled steps: ``step()`` runs one more (checked) decode step of the batch
    and returns its KV lengths (what a probe observes, e.g. the router's choices, never timed)."""
    if engine.has_unfinished():
        raise RuntimeError("measure_decode needs an idle engine (it aborts every request it adds)")
    if steps < 1 or warmup_tokens < 1:
        raise ValueError(f"steps={steps} and warmup_tokens={warmup_tokens} must be >= 1")
    batch, context_len = len(prompts), len(prompts[0])
    n_profile = profile_steps if busy_device else 0
    max_tokens = decode_max_tokens(batch, context_len, engine.config.max_num_batched_tokens, warmup_tokens,
                                   steps, n_profile + (probe is not None))
    if forced is not None:
        if len(forced) != batch:
            raise ValueError(f"forced has {len(forced)} token lists for {batch} prompts")
        for i, f in enumerate(forced):
            if len(f) < max_tokens:
                raise ValueError(f"forced[{i}] (prompt {i}) has {len(f)} token ids; the request may generate "
                                 f"max_tokens={max_tokens} (decode_max_tokens), so it needs at least that many")
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                             forced_token_ids=None if forced is None else list(forced[i])) for i in range(batch)]
    ids = [f"{tag}-{batch}-{i}" for i in range(batch)]
    generated = dict.fromkeys(ids, 0)
    tokens: dict[str, list[int]] = {}
    try:
        for rid, p, sp in zip(ids, prompts, params):
            engine.add_request(rid, p, sp)
        for _ in range(max_tokens):  # prefill everything, then warm up
            if min(generated.values()) >= warmup_tokens:
                break
            for out in engine.step():
                if out.finished:
                    raise NotADecodeStep(f"request {out.request_id} finished during warm-up "
                                         f"({out.outputs[0].finish_reason}); max_tokens={max_tokens} too small")
                generated[out.request_id] = len(out.outputs[0].token_ids)
        else:
            raise NotADecodeStep(f"{sum(g < warmup_tokens for g in generated.values())} sequences still had "
                                 f"fewer than {warmup_tokens} tokens after {max_tokens} steps")
        before = engine.stats()
        wall, lens = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            ctx = _decode_step(engine, ids, generated, context_len, tokens)
            wall.append(time.perf_counter() - t0)
            lens.append(ctx)
        after = engine.stats()
        times = DecodeTimes(wall, lens, after["graph_replays"] - before["graph_replays"],
                            lookup_exposed_s=after["lookup_exposed_s"] - before["lookup_exposed_s"],
                            tables=(before["tables"], after["tables"]))
        if n_profile:
            from engram.bench.device_time import measure_profile

            def profiled() -> None:
                for _ in range(n_profile):
                    times.busy_context_lens.append(_decode_step(engine, ids, generated, context_len, tokens))

            prof = measure_profile(profiled, busy_device)
            times.busy_s, times.kernels = prof.busy_s / n_profile, prof.kernels
        if engine.stats()["preemptions"] != before["preemptions"]:
            raise NotADecodeStep("a sequence was preempted during the timed steps (KV cache too small)")
        times.token_ids = [list(tokens[rid]) for rid in ids]
        if probe is not None:
            probe(lambda: _decode_step(engine, ids, generated, context_len, tokens))
        return times
    finally:
        for rid in ids:
            engine.abort_request(rid)


def _prefill_step(engine, prompts: list[list[int]], tag: str) -> float:
    """Add one request per prompt, run one step, check every prompt was prefilled whole; host seconds."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    try:
        for rid, p in zip(ids, prompts):
            engine.add_request(rid, p, params)
        t0 = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - t0
        done = {o.request_id for o in outs if o.finished and len(o.outputs[0].token_ids) == 1}
        if done != set(ids) or engine.has_unfinished():
            raise NotAPrefillStep(f"one step prefilled {len(done)} of {len(ids)} prompts of {len(prompts[0])} "
                                  f"tokens: raise max_num_batched_tokens / max_num_seqs or the KV cache")
        return elapsed
    finally:
        for rid in ids:
            engine.abort_request(rid)


def measure_prefill(engine, num_seqs: int, length: int, vocab_size: int, repeats: int = 3,
                    busy_device: str | None = None, seed: int = 0) -> PrefillTimes:
    """Time single steps that prefill ``num_seqs`` fresh prompts of ``length`` tokens; every shot draws new ids."""
    if engine.has_unfinished():
        raise RuntimeError("measure_prefill needs an idle engine")
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    tag = f"prefill-{num_seqs}x{length}"
    shot = iter(range(seed, seed + repeats + 2))

    def one(name: str) -> float:
        return _prefill_step(engine, prompt_ids(num_seqs, length, vocab_size, next(shot)), f"{tag}-{name}")

    one("warmup")
    times = PrefillTimes([one(f"t{r}") for r in range(repeats)])
    if busy_device:
        from engram.bench.device_time import measure_busy

        times.busy_s = measure_busy(lambda: one("profiled"), busy_device)
    return times
