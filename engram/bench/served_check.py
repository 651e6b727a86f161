"""``engram check --served``: output equivalence on the serving path. Each arm is a real ``engram serve`` (started one at
a time on a free port, so two arms never share a device), sent the same prompts as token ids, greedy with ``ignore_eos``,
``logprobs`` and ``return_tokens_as_token_ids`` (the served token ids, not their text); every arm after the first is
compared with the first, request by request.

Probes (``SERVED_PROBES``), each after ``POST /reset_prefix_cache`` so that no probe sees another's cached blocks:

- ``burst``: every prompt in one completions request (a list of prompts). The server admits a response's choices
  together, before its next step, and batch composition is a function of the requests alone (docs/engine.md), so two
  arms with the same batch-shaping options run the same batches: the step trace of the probe (``GET /engram/steps``:
  tokens, sequences, decodes, sampled rows, KV read, attended pairs per step) shows it. Compared **bitwise** (token
  ids, logprobs and top-k at every position) when both traces are equal, else under the near-tie rule.
- ``concurrent``: one streamed request per prompt, all in flight at once, so batches form as arrival order makes them,
  which can differ between two servers: always under the **near-tie** rule (check.compare).
"""
from __future__ import annotations

import asyncio
import json
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from engram.bench.check import DIVERGED, EQUAL, NEAR_TIE, Comparison, compare, compare_bitwise
from engram.engine.step import TokenLogprobs

SERVED_PROBES = ("burst", "concurrent")
BITWISE, NEAR_TIE_RULE = "bitwise", "near-tie"
TOP_K = 2  # logprobs alternatives asked for: the near-tie rule needs the top-2 gap
START_TIMEOUT_S = 900.0  # a large preset builds its tables and captures its graphs before /health answers
REQUEST_TIMEOUT_S = 3600.0
TOKEN_ID_PREFIX = "token_id:"  # vLLM's return_tokens_as_token_ids strings


class ServedCheckError(RuntimeError):
    """A server that would not start or answered a probe with an error: the message names the arm and the probe."""


@dataclass
class ServedArm:
    name: str  # "a", "b", ...: the option it came from
    argv: list[str]  # the `engram serve` command line, the model first (no --port: the launcher picks one)
    spec: dict[str, Any]  # the arm as given (reported)
    # the settings that change a step's arithmetic (dtype, device, ...): arms that differ in one are never bitwise
    arithmetic: dict[str, Any] = field(default_factory=dict)


@dataclass
class ProbeRun:
    """One probe on one arm: every request's (token ids, TokenLogprobs), in prompt order, and the probe's steps."""

    probe: str
    outputs: list[tuple[list[int], list[TokenLogprobs]]]
    shapes: list[tuple[int, ...]]  # per step (tokens, sequences, decodes, sampled rows, KV read, attended pairs)
    seconds: float


@dataclass
class ArmRun:
    arm: ServedArm
    model: str  # the served model name (GET /v1/models)
    probes: dict[str, ProbeRun]
    preemptions: int | None  # engine.stats()["preemptions"] after the last probe


# ----------------------------------------------------------------- the client side
def token_id(text: str, where: str) -> int:
    """The id in a ``"token_id:N"`` string; ValueError naming ``where`` for anything else."""
    if not isinstance(text, str) or not text.startswith(TOKEN_ID_PREFIX) or \
            not text[len(TOKEN_ID_PREFIX):].isdigit():
        raise ValueError(f"{where}: token {text!r} is not {TOKEN_ID_PREFIX}N (the server ignored "
                         "return_tokens_as_token_ids)")
    return int(text[len(TOKEN_ID_PREFIX):])


def legacy_logprobs(lp: dict | None, where: str) -> list[TokenLogprobs]:
    """A completions ``logprobs`` object (tokens as ``token_id:N``) -> one TokenLogprobs per token."""
    if lp is None:
        raise ValueError(f"{where}: no logprobs in the response")
    out = []
    for i, (tok, own, top) in enumerate(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True)):
        at = f"{where} token {i}"
        out.append(TokenLogprobs(token_id(tok, at), own, [(token_id(t, at), v) for t, v in top.items()]))
    return out


def request_body(model: str, prompt: Any, max_tokens: int, stream: bool) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": TOP_K, "return_tokens_as_token_ids": True, "stream": stream}


def _http_error(r, what: str) -> ServedCheckError:
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = r.text[:300]
    return ServedCheckError(f"{what}: HTTP {r.status_code}: {message}")


async def run_burst(client, model: str, prompts: list[list[int]], max_tokens: int):
    """Every prompt in one request; the choices' (ids, logprobs) in prompt order."""
    r = await client.post("/v1/completions", json=request_body(model, prompts, max_tokens, False))
    if r.status_code != 200:
        raise _http_error(r, "burst")
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    outs = [legacy_logprobs(c["logprobs"], f"burst request {c['index']}") for c in choices]
    return [([t.token_id for t in lps], lps) for lps in outs]


async def _one_stream(client, model: str, prompt: list[int], max_tokens: int, i: int):
    where = f"concurrent request {i}"
    lps: list[TokenLogprobs] = []
    async with client.stream("POST", "/v1/completions", json=request_body(model, prompt, max_tokens, True)) as r:
        if r.status_code != 200:
            await r.aread()
            raise _http_error(r, where)
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise ServedCheckError(f"{where}: the stream failed: {event['error'].get('message')}")
            for c in event.get("choices", []):
                if c.get("logprobs"):
                    lps += legacy_logprobs(c["logprobs"], where)
    return [t.token_id for t in lps], lps


async def run_concurrent(client, model: str, prompts: list[list[int]], max_tokens: int):
    """One streamed request per prompt, all sent at once; their (ids, logprobs) in prompt order."""
    return list(await asyncio.gather(*(_one_stream(client, model, p, max_tokens, i) for i, p in enumerate(prompts))))


RUNNERS = {"burst": run_burst, "concurrent": run_concurrent}


def _shapes(records) -> list[tuple[int, ...]]:
    return [(r.num_tokens, r.num_seqs, r.num_decode, r.sampled, r.kv_read, r.attended) for r in records]


def _last_step(url: str) -> int:
    from engram.bench.serve_counters import fetch_steps

    got = fetch_steps(url, -1)
    if got is None:
        raise ServedCheckError(f"{url} has no GET /engram/steps: not an engram server")
    return got[0][-1].step_id if got[0] else -1


async def _send(url: str, probe: str, model: str, prompts: list[list[int]], max_tokens: int):
    import httpx

    from engram.bench.serve_client import KEEPALIVE_EXPIRY_S

    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts),
                          keepalive_expiry=KEEPALIVE_EXPIRY_S)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        return await RUNNERS[probe](client, model, prompts, max_tokens)


def run_probes(url: str, probes: Sequence[str], prompts: list[list[int]], max_tokens: int) -> tuple[str, dict, dict]:
    """(served model name, {probe: ProbeRun}, the engine's stats after them) from a ready server at ``url``."""
    import httpx

    from engram.bench.serve_counters import fetch_steps

    model = httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["id"]
    runs, stats = {}, {}
    for probe in probes:
        reset = httpx.post(url + "/reset_prefix_cache", timeout=60)
        if reset.status_code != 200:
            raise _http_error(reset, f"{probe}: POST /reset_prefix_cache")
        since = _last_step(url)
        t0 = time.perf_counter()
        outputs = asyncio.run(_send(url, probe, model, prompts, max_tokens))
        seconds = time.perf_counter() - t0
        if len(outputs) != len(prompts):
            raise ServedCheckError(f"{probe}: {len(outputs)} choices served for {len(prompts)} prompts")
        for i, (ids, _) in enumerate(outputs):
            if len(ids) != max_tokens:
                raise ServedCheckError(f"{probe} request {i}: {len(ids)} tokens served, {max_tokens} asked for with "
                                       "ignore_eos")
        records, stats = fetch_steps(url, since)
        runs[probe] = ProbeRun(probe, outputs, _shapes(records), seconds)
    return model, runs, stats


def run_arm(arm: ServedArm, probes: Sequence[str], prompts: list[list[int]], max_tokens: int, log_dir: Path,
            say=lambda msg: None) -> ArmRun:
    """Start arm's server, run the probes, stop it (also on failure); a server that does not start or a probe that
    fails is a ServedCheckError naming the arm and the server's log."""
    from engram.server.launcher import ServerProcess

    log = log_dir / f"arm-{arm.name}.log"
    say(f"arm {arm.name}: engram serve {shlex.join(arm.argv)} (log: {log})")
    server = ServerProcess(arm.argv, None, log)
    try:
        try:
            server.wait_ready(START_TIMEOUT_S)
        except (RuntimeError, TimeoutError) as e:
            raise ServedCheckError(f"arm {arm.name}: the server did not start: {e}") from None
        try:
            model, runs, stats = run_probes(server.url, probes, prompts, max_tokens)
        except (ServedCheckError, ValueError) as e:
            raise ServedCheckError(f"arm {arm.name}: {e} (server log: {log})") from None
    finally:
        server.stop()
    return ArmRun(arm, model, runs, stats.get("preemptions"))


# ----------------------------------------------------------------- comparison
@dataclass
class PairProbe:
    """One probe compared between the first arm and another."""

    arms: str  # "a:b"
    probe: str
    rule: str  # BITWISE | NEAR_TIE_RULE
    batches: str  # "same (N steps)" or where the step traces first differ
    why: str  # why this rule: the batches, or the arithmetic settings the arms differ in
    comparisons: list[Comparison] = field(default_factory=list)


def _batches(sa: list[tuple], sb: list[tuple], a: str, b: str) -> str | None:
    """None when both step traces are equal, else where they first differ."""
    if sa == sb:
        return None
    k = next((i for i, (x, y) in enumerate(zip(sa, sb)) if x != y), min(len(sa), len(sb)))
    show = lambda s: "no step" if k >= len(s) else f"{s[k][0]} tokens {s[k][1]} seqs"  # noqa: E731
    return f"differ at step {k} of {len(sa)}/{len(sb)} ({a}: {show(sa)}; {b}: {show(sb)})"


def compare_runs(first: ArmRun, other: ArmRun, prompts: list[list[int]], near_tie: float) -> list[PairProbe]:
    """Each probe of ``other`` against ``first``: bitwise for a burst whose step traces match between arms that agree
    on every arithmetic setting; otherwise the near-tie rule, saying why."""
    a, b = first.arm.name, other.arm.name
    arith = [f"{k} {first.arm.arithmetic[k]!r} vs {other.arm.arithmetic.get(k)!r}" for k in first.arm.arithmetic
             if first.arm.arithmetic[k] != other.arm.arithmetic.get(k)]
    out = []
    for probe, ra in first.probes.items():
        rb = other.probes[probe]
        differ = _batches(ra.shapes, rb.shapes, a, b)
        if probe != "burst":
            why = "arrival order"
        else:
            why = "batches differ" if differ else ("arithmetic differs: " + ", ".join(arith) if arith else "same batches")
        rule = BITWISE if probe == "burst" and differ is None and not arith else NEAR_TIE_RULE
        pp = PairProbe(f"{a}:{b}", probe, rule, differ or f"same ({len(ra.shapes)} steps)", why)
        for i, (p, oa, ob) in enumerate(zip(prompts, ra.outputs, rb.outputs)):
            pp.comparisons.append(compare_bitwise(probe, i, len(p), oa, ob) if rule == BITWISE
                                  else compare(probe, i, len(p), oa, ob, near_tie))
        out.append(pp)
    return out


@dataclass
class ServedReport:
    pairs: list[PairProbe]
    arms: list[ArmRun]

    @property
    def exit_code(self) -> int:
        """0 when every request is equal (bitwise probes) or equal up to near-ties, 1 on any divergence."""
        return 1 if any(c.status == DIVERGED for p in self.pairs for c in p.comparisons) else 0

    def first_difference(self) -> str | None:
        """The first divergence, in arm, probe and request order: where, and both tokens with their logprobs."""
        for p in self.pairs:
            for c in p.comparisons:
                if c.status == DIVERGED:
                    a, b = p.arms.split(":")
                    return (f"first difference: arms {p.arms}, probe {p.probe} ({p.rule}), request {c.request}, "
                            f"position {c.position}: arm {a} token {c.token_a} (logprob {c.logprob_a!r}), arm {b} "
                            f"token {c.token_b} (logprob {c.logprob_b!r})")
        return None

    def summary_rows(self) -> list[dict[str, Any]]:
        return [{"arms": p.arms, "probe": p.probe, "rule": p.rule, "why": p.why, "requests": len(p.comparisons),
                 "equal": sum(c.status == EQUAL for c in p.comparisons),
                 "near-ties": sum(c.status == NEAR_TIE for c in p.comparisons),
                 "diverged": sum(c.status == DIVERGED for c in p.comparisons), "batches": p.batches}
                for p in self.pairs]

    def difference_rows(self) -> list[dict[str, Any]]:
        return [{"arms": p.arms, "probe": p.probe, "request": c.request, "status": c.status, "position": c.position,
                 "token a": c.token_a, "logprob a": repr(c.logprob_a), "token b": c.token_b,
                 "logprob b": repr(c.logprob_b), "gap a": c.gap_a, "gap b": c.gap_b}
                for p in self.pairs for c in p.comparisons if c.status != EQUAL]

    def to_dict(self) -> dict[str, Any]:
        statuses = {c.status for p in self.pairs for c in p.comparisons}
        verdict = "diverged" if self.exit_code else ("equal" if statuses <= {EQUAL} else "equal up to near-ties")
        return {"verdict": verdict, "exit_code": self.exit_code, "first_difference": self.first_difference(),
                "probes": self.summary_rows(),
                "arm_runs": {r.arm.name: {"argv": r.arm.argv, "served_model": r.model, "preemptions": r.preemptions,
                                          "probes": {n: {"steps": len(pr.shapes), "seconds": round(pr.seconds, 3)}
                                                     for n, pr in r.probes.items()}} for r in self.arms},
                "requests": [{"arms": p.arms, "rule": p.rule, **c.to_dict()} for p in self.pairs
                             for c in p.comparisons]}


def run_served_check(arms: Sequence[ServedArm], probes: Sequence[str], prompts: list[list[int]], max_tokens: int,
                     near_tie: float, log_dir: Path, say=lambda msg: None) -> ServedReport:
    """Every arm's server in turn, then every arm after the first compared with the first."""
    runs = [run_arm(arm, probes, prompts, max_tokens, log_dir, say) for arm in arms]
    pairs = [pp for other in runs[1:] for pp in compare_runs(runs[0], other, prompts, near_tie)]
    return ServedReport(pairs, runs)
