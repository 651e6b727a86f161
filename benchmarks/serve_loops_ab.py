"""Interleaved serving A/B of the server's engine loops, with an A/A control: each round runs ``engram bench serve``
(its own fresh server, this tree) three times, arms in the order A, B, A' -- A and A' ``--engine-loop thread``, B
``--engine-loop process`` (``--a`` / ``--b`` change them; ``--a-serve-args`` / ``--b-serve-args`` add server options
of one side, so the same A/B compares an engine setting, e.g. ``--b-serve-args=--prompt-prefetch``) -- and the summary
sets B/A beside A'/A, so a difference is read against the spread of two identical arms:

    python -m benchmarks.serve_loops_ab --rounds 3 --dir DIR --out DIR/summary.json -- BENCH_SERVE_ARGS...

BENCH_SERVE_ARGS go to every `engram bench serve` (model, workload, concurrency; give server options through
``--serve-args``: the arm's ``--engine-loop`` is appended to them). Per arm and round the bench's JSON is kept in
DIR; the summary has each arm's median over rounds of output tok/s, TPOT / ITL / TTFT p50, GPU idle share of wall and
host gap p50 (CUDA), errors, and the ratios.
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


def run_arm(bench: list[str], serve_args: str, loop: str, out: Path) -> dict:
    """One `engram bench serve` with ``--engine-loop loop`` -> the metrics of its result."""
    args = [*bench, f"--serve-args={serve_args} --engine-loop {loop}".strip(), "--out", str(out)]
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
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--a", default="thread", help="engine loop of arms A and A' (the control pair)")
    p.add_argument("--b", default="process", help="engine loop of arm B")
    p.add_argument("--a-serve-args", default="", help="server options of arms A and A' only (e.g. an engine setting)")
    p.add_argument("--b-serve-args", default="", help="server options of arm B only")
    p.add_argument("--dir", required=True, help="directory for each arm's bench JSON and log")
    p.add_argument("--out", required=True, help="the summary JSON")
    args = p.parse_args(argv[:split])
    bench = argv[split + 1:]
    serve_args = ""
    for i, a in enumerate(bench):  # the arms' --engine-loop joins the caller's server options
        if a.startswith("--serve-args="):
            serve_args = a.split("=", 1)[1]
        elif a == "--serve-args" and i + 1 < len(bench):
            serve_args = bench[i + 1]
    bench = [a for i, a in enumerate(bench) if not a.startswith("--serve-args")
             and not (i > 0 and bench[i - 1] == "--serve-args")]
    out_dir = Path(args.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    arms: dict[str, list[dict]] = {"A": [], "B": [], "A'": []}
    for r in range(args.rounds):
        for arm, loop, own in (("A", args.a, args.a_serve_args), ("B", args.b, args.b_serve_args),
                               ("A'", args.a, args.a_serve_args)):
            row = run_arm(bench, f"{serve_args} {own}".strip(), loop,
                          out_dir / f"{arm.replace(chr(39), '2')}-{loop}-{r}.json")
            print(json.dumps({"round": r, "arm": arm, "loop": loop, **row}), flush=True)
            arms[arm].append(row)
    summary = {"a": args.a, "b": args.b, "a_serve_args": args.a_serve_args, "b_serve_args": args.b_serve_args,
               "bench_args": bench, "serve_args": serve_args, **summarize(arms)}
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("median", "B/A", "A'/A")}, indent=1))
    return 0 if all(r["exit_status"] == 0 for rows in arms.values() for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
