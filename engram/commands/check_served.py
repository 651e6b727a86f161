"""`engram check --served`: the check on the serving path (engram/bench/served_check.py). An arm is a JSON object of
`engram serve` options by their names (``tier``, ``dtype``, ``device``, ``engram_config``, ``max_num_seqs``,
``enforce_eager``, ``prompt_prefetch``, ``dedup_rows``, ...; a true / false for a switch), plus ``model`` (this arm's
preset or checkpoint directory instead of MODEL: a re-converted or repaired checkpoint). Each arm becomes an
`engram serve` command line that serve's own parser and option checks accept before any server starts.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

REFUSED = ("host", "port", "help")  # the launcher binds 127.0.0.1 on a free port
# serve options that change a step's arithmetic, not only its mechanism: arms that differ in one are compared under
# the near-tie rule even where their batches match (docs/design.md, determinism policy)
ARITHMETIC = ("dtype", "device", "tensor_parallel_size", "speculative_config")


def _serve_parser() -> argparse.ArgumentParser:
    from engram.commands import serve

    p = argparse.ArgumentParser(prog="engram serve", exit_on_error=False)
    serve.add_arguments(p)
    return p


def serve_argv(model: str, raw: dict[str, Any], opt: str, threads: int | None) -> tuple[list[str], argparse.Namespace]:
    """The `engram serve` arguments of one arm (``opt``: "--a", ...) and serve's parse of them, checked by serve's
    parser and ``check_options``; ValueError naming ``opt`` and the key otherwise."""
    from engram.commands.options import check_options

    parser = _serve_parser()
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in REFUSED}
    argv = [str(raw.get("model", model))]
    for key, value in raw.items():
        if key == "model":
            continue
        action = actions.get(key)
        if action is None:
            raise ValueError(f"{opt}: {key!r} is not an `engram serve` option (the check picks host and port); "
                             f"known: {sorted(['model', *actions])}")
        flag = action.option_strings[0]
        if isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreTrueAction)):
            if not isinstance(value, bool) and not (value is None and isinstance(action, argparse.BooleanOptionalAction)):
                raise ValueError(f"{opt}: {key}={value!r} must be true or false")
            if isinstance(action, argparse.BooleanOptionalAction) and value is not None:
                argv.append(flag if value else "--no-" + flag[2:])
            elif value:
                argv.append(flag)
        elif value is not None:
            argv += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    if threads is not None and "threads" not in raw:
        argv += ["--threads", str(threads)]
    try:
        args = parser.parse_args(argv)
        check_options(args)
    except (argparse.ArgumentError, ValueError) as e:
        raise ValueError(f"{opt}: {e}") from None
    except SystemExit as e:  # a byte-count or JSON option's own type check
        raise ValueError(f"{opt}: {e}") from None
    return argv, args


def arithmetic(serve: argparse.Namespace) -> dict[str, Any]:
    """The ARITHMETIC settings of a parsed `engram serve` command line, defaults resolved as the server resolves them
    on this machine (device: cuda when there is one; dtype: bfloat16 on CUDA, float32 elsewhere)."""
    import torch

    from engram.model.loader import resolve_dtype

    device = torch.device(serve.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = {k: getattr(serve, k) for k in ARITHMETIC}
    out.update(device=f"cuda:{device.index or 0}" if device.type == "cuda" else device.type,
               dtype=str(resolve_dtype(serve.dtype, device)).removeprefix("torch."))
    return out


def served_arms(args: argparse.Namespace):
    """The ServedArms of --a, --b (and --c), validated, with the same model's weights and tables in every arm unless an
    arm names its own ``model``; ValueError naming the option otherwise."""
    from engram.bench.check import ArmSpec, check_same_model
    from engram.bench.served_check import ServedArm
    from engram.config import parse_json_object

    arms = []
    for name in ("a", "b", "c"):
        text = getattr(args, name)
        if text is None:
            continue
        raw = parse_json_object(text, f"--{name}")
        argv, serve = serve_argv(args.model, raw, f"--{name}", args.threads)
        arms.append(ServedArm(name, argv, raw, arithmetic(serve)))
        engram = raw.get("engram_config") or {}
        check_same_model(ArmSpec("a", engram_config=arms[0].spec.get("engram_config") or {}),
                         ArmSpec(name, engram_config=engram))
    return arms


def probe_names(args: argparse.Namespace) -> list[str]:
    from engram.bench.served_check import SERVED_PROBES

    names = [n.strip() for n in (args.probes or ",".join(SERVED_PROBES)).split(",") if n.strip()]
    bad = [n for n in names if n not in SERVED_PROBES]
    if bad or not names:
        raise ValueError(f"--probes={args.probes!r}: {bad or 'none given'}; with --served choose from "
                         f"{list(SERVED_PROBES)}")
    return list(dict.fromkeys(names))


def run(args: argparse.Namespace, prompt_texts, say) -> int:
    """The served check as the command line says, on the prompts ``prompt_texts(args)`` gives (the offline check's);
    exit status as `engram check`'s: 0 equal (or near-ties only), 1 diverged, 2 a bad option or a failed server."""
    import shlex
    import sys
    import tempfile
    import time
    from pathlib import Path

    from engram.bench import report
    from engram.bench.served_check import ServedCheckError, run_served_check
    from engram.bench.serve_workload import model_tokenizer

    try:
        arms = served_arms(args)
        names = probe_names(args)
        texts, source = prompt_texts(args)
        prompts = [list(map(int, ids)) for ids in model_tokenizer(args.model).encode(texts)]
        log_dir = Path(tempfile.mkdtemp(prefix="engram-check-"))
        say(f"{len(arms)} arms, one server at a time; {len(names)} probes x {len(prompts)} requests x "
            f"{args.max_tokens} tokens each (server logs: {log_dir})")
        t0 = time.perf_counter()
        result = run_served_check(arms, names, prompts, args.max_tokens, args.near_tie, log_dir, say)
    except (ValueError, OSError, ServedCheckError) as e:
        print(f"engram check: error: {e}", file=sys.stderr)
        return 2
    doc = {"model": args.model, "served": True, "arms": {a.name: {"spec": a.spec, "argv": a.argv} for a in arms},
           "prompts": {**source, "requests": len(prompts), "prompt_tokens": [len(p) for p in prompts]},
           "seconds": round(time.perf_counter() - t0, 3), **result.to_dict()}
    print(report.format_table(result.summary_rows()))
    if result.difference_rows():
        print()
        print(report.format_table(result.difference_rows(), floatfmt="{:.3g}"))
    first = result.first_difference()
    if first:
        print(f"\n{first}")
    print(f"{doc['verdict']}: " + ", ".join(f"arm {a.name} (engram serve {shlex.join(a.argv)})" for a in arms))
    if args.json:
        print(f"wrote {report.write_result('check', report.args_config(args), doc, out=args.json)}")
    return result.exit_code
