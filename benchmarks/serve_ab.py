"""Interleaved serving A/B of two `engram serve` option sets, with an A/A control: each round runs ``engram bench
serve`` (its own fresh server, this tree) three times, arms in the order A, B, A' -- A and A' with the server options
``--a-serve-args``, B with ``--b-serve-args`` (e.g. ``--b-serve-args=--prompt-prefetch``) -- and the summary sets B/A
beside A'/A, so a difference is read against the spread of two identical arms:

    python -m benchmarks.serve_ab --rounds 3 [--a-serve-args ARGS] [--b-serve-args ARGS] --dir DIR \\
        --out DIR/summary.json -- BENCH_SERVE_ARGS...

BENCH_SERVE_ARGS go to every `engram bench serve` (model, workload, concurrency; server options both arms share go in
its ``--serve-args``, and each arm's own are appended to them). Per arm and round the bench's JSON and log are kept in
DIR; the summary has each arm's median over rounds of output tok/s, TPOT / ITL / TTFT p50, errors, GPU idle share of
wall and host gap p50 (CUDA), the lookup counters and the hot-row cache's hit rate, and the ratios. The exit status is
1 when any arm's bench failed.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

METRICS = ("output_tokens_per_s", "tpot_p50_s", "itl_p50_s", "ttft_p50_s", "errors")
COUNTERS = ("gpu_idle_share", "host_gap_p50_s", "steps", "eager_steps")
LOOKUPS = ("lookup_exposed_s", "host_gap_s")  # the window's lookup counters (bench/serve_counters.py)
ARMS = ("A", "B", "A'")  # the order of each round; A' repeats A (the control)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=3, help="rounds of A, B, A' (default: %(default)s)")
    p.add_argument("--a-serve-args", default="", help="server options of arms A and A' (the control pair)")
    p.add_argument("--b-serve-args", default="", help="server options of arm B")
    p.add_argument("--dir", required=True, help="directory for each arm's bench JSON and log")
    p.add_argument("--out", required=True, help="the summary JSON")
    p.add_argument("bench", nargs="*", metavar="BENCH_SERVE_ARGS", help="after --: the `engram bench serve` options")


def split_serve_args(bench: list[str]) -> tuple[list[str], str]:
    """``bench`` without its ``--serve-args`` -> (the rest, the shared server options, "" when none)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--serve-args", default="")
    shared, rest = p.parse_known_args(bench)
    return rest, shared.serve_args


def run_arm(bench: list[str], serve_args: str, out: Path) -> dict:
    """One `engram bench serve` with server options ``serve_args`` -> the metrics of its result."""
    args = [*bench, f"--serve-args={serve_args}", "--out", str(out)]
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        code = subprocess.run([sys.executable, "-m", "engram", "bench", "serve", *args], stdout=f,
                              stderr=subprocess.STDOUT).returncode
    if not out.is_file():
        raise RuntimeError(f"engram bench serve {shlex.join(args)} exited {code} without a result; see {log}")
    result = json.loads(out.read_text())["result"]
    counters = result.get("counters", {})
    lookups = counters.get("lookups", {})
    return {**{k: result.get(k) for k in METRICS}, **{k: counters.get(k) for k in COUNTERS},
            **{k: lookups.get(k) for k in LOOKUPS}, "hit_rate": (counters.get("hot_cache") or {}).get("hit_rate"),
            "exit_status": code}


def _median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def summarize(arms: dict[str, list[dict]]) -> dict:
    """Each arm's medians over rounds, and B/A and A'/A of each metric (None where a median is missing or zero)."""
    med = {arm: {k: _median(rows, k) for k in (*METRICS, *COUNTERS, *LOOKUPS, "hit_rate")} for arm, rows in arms.items()}

    def ratio(x: str, y: str) -> dict:
        return {k: med[x][k] / med[y][k] if med[x][k] is not None and med[y][k] else None for k in METRICS[:4]}

    return {"median": med, "B/A": ratio("B", "A"), "A'/A": ratio("A'", "A"), "rounds": arms}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.rounds < 1:
        p.error(f"--rounds={args.rounds} must be >= 1")
    bench, shared = split_serve_args(args.bench)
    own = {"A": args.a_serve_args, "B": args.b_serve_args, "A'": args.a_serve_args}
    out_dir = Path(args.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    arms: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        for arm in ARMS:
            serve_args = f"{shared} {own[arm]}".strip()
            row = run_arm(bench, serve_args, out_dir / f"{arm.replace(chr(39), '2')}-{r}.json")
            print(json.dumps({"round": r, "arm": arm, "serve_args": serve_args, **row}), flush=True)
            arms[arm].append(row)
    summary = {"a_serve_args": args.a_serve_args, "b_serve_args": args.b_serve_args, "bench_args": bench,
               "serve_args": shared, **summarize(arms)}
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("median", "B/A", "A'/A")}, indent=1))
    return 0 if all(r["exit_status"] == 0 for rows in arms.values() for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
