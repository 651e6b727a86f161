"""Run named entries of benchmarks/suite.toml: the commands behind the numbers of docs/benchmarks.md.

    python benchmarks/run_suite.py NAME... --out DIR [--disk DIR] [--dry-run]
    python benchmarks/run_suite.py --list

Each entry runs as its own process from the repository root, in the order given; its stdout and stderr go
to DIR/NAME.log, its result to DIR/NAME.json ({out} in the entry's argv), and DIR/suite.json records every
entry run (argv, exit status, seconds, commit). The runner stops at nothing: a failed entry is reported and
the next one runs; the exit status is 1 when any failed. It does not check what an entry needs (cuda or
cpu): that is the caller's choice of machine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE = Path(__file__).with_name("suite.toml")


def load_suite(path: Path = SUITE) -> dict[str, dict]:
    """The suite's entries by name, each checked for the keys the runner and the docs rely on."""
    entries = tomllib.loads(path.read_text())["entry"]
    suite: dict[str, dict] = {}
    for e in entries:
        missing = {"name", "section", "needs", "what", "argv"} - e.keys()
        if missing:
            raise ValueError(f"{path.name}: entry {e.get('name', '?')!r} lacks {sorted(missing)}")
        if e["needs"] not in ("cuda", "cpu"):
            raise ValueError(f"{path.name}: entry {e['name']!r}: needs={e['needs']!r} is neither 'cuda' nor 'cpu'")
        if e["name"] in suite:
            raise ValueError(f"{path.name}: entry name {e['name']!r} appears twice")
        suite[e["name"]] = e
    return suite


def command(entry: dict, out_dir: Path, disk: str | None) -> list[str]:
    """The entry's argv with its placeholders filled and "engram" / "python" bound to this interpreter."""
    values = {"out": str(out_dir / f"{entry['name']}.json"), "dir": str(out_dir)}
    if any("{disk}" in a for a in entry["argv"]):
        if not disk:
            raise ValueError(f"entry {entry['name']!r} reads a disk under test: pass --disk DIR "
                             "(or set ENGRAM_CACHE_DIR)")
        values["disk"] = disk
    argv = []
    for a in entry["argv"]:  # plain replacement: JSON arguments keep their braces
        for key, value in values.items():
            a = a.replace("{" + key + "}", value)
        argv.append(a)
    head = {"engram": [sys.executable, "-m", "engram"], "python": [sys.executable]}.get(argv[0], argv[:1])
    return head + argv[1:]


def git_commit() -> str:
    """ENGRAM_COMMIT when set (a copied tree's .git may be stale), else git's HEAD."""
    if os.environ.get("ENGRAM_COMMIT"):
        return os.environ["ENGRAM_COMMIT"]
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("names", nargs="*", metavar="NAME", help="suite entries to run, in this order")
    p.add_argument("--out", type=Path, help="directory for NAME.json, NAME.log and suite.json")
    p.add_argument("--disk", default=os.environ.get("ENGRAM_CACHE_DIR"),
                   help="directory on the disk under test, for entries that generate or read table files")
    p.add_argument("--list", action="store_true", help="print the entries and exit")
    p.add_argument("--dry-run", action="store_true", help="print the commands instead of running them")
    p.add_argument("--suite", type=Path, default=SUITE, help=argparse.SUPPRESS)  # tests run a suite of their own
    args = p.parse_args(argv)
    suite = load_suite(args.suite)
    if args.list:
        for e in suite.values():
            print(f"{e['name']:<18} {e['needs']:<5} {e['section']}: {e['what']}")
        return 0
    unknown = [n for n in args.names if n not in suite]
    if unknown or not args.names:
        p.error(f"unknown entries {unknown}; --list shows them" if unknown else "name at least one entry")
    if args.out is None:
        p.error("--out DIR is required")
    try:
        commands = {n: command(suite[n], args.out.resolve(), args.disk) for n in args.names}
    except ValueError as e:
        p.error(str(e))
    if args.dry_run:
        for n, cmd in commands.items():
            print(f"{n}: {subprocess.list2cmdline(cmd)}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    record_path = args.out / "suite.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {"runs": []}
    commit, failed = git_commit(), []
    for n, cmd in commands.items():
        print(f"[{n}] {subprocess.list2cmdline(cmd)}", flush=True)
        started = time.time()
        with open(args.out / f"{n}.log", "w") as log:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
        seconds = round(time.time() - started, 1)
        print(f"[{n}] exit {rc} after {seconds} s; log {args.out / f'{n}.log'}", flush=True)
        record["runs"].append({"name": n, "argv": cmd, "rc": rc, "seconds": seconds, "commit": commit,
                               "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started))})
        record_path.write_text(json.dumps(record, indent=1) + "\n")
        if rc != 0:
            failed.append(n)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
