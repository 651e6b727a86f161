"""``engram bench ab``: A/B any two shell commands that print a number, interleaved, with an A/A control. A sample is
one run: the last stdout line as a number, a JSON field (``--field``) or the wall time (``--wall-time``). An arm may
have a background service (``--a-setup``/``--b-setup``), restarted per block with ``--restart``."""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from engram.bench.stats import ORDERS, ABConfig, Arm, Run

HELP = "A/B two shell commands that print a number: interleaved runs, A/A control, bootstrap CI, verdict."

_PATH_TOKEN = re.compile(r"\.?([^.\[\]]+)|\[(\d+)\]")


class CommandError(RuntimeError):
    """An arm's command failed or printed no usable number; the message names the arm and command."""


def json_field(doc: Any, path: str) -> Any:
    """Follow a path like ``$.timings.tok_s``, ``runs[2].ms`` or ``runs.2.ms`` into parsed JSON."""
    rest = path[1:] if path.startswith("$") else path
    pos, node = 0, doc
    while pos < len(rest):
        m = _PATH_TOKEN.match(rest, pos)
        if m is None:
            raise ValueError(f"--field {path!r}: cannot parse at character {pos + len(path) - len(rest)}")
        key = m.group(1) if m.group(1) is not None else int(m.group(2))
        if isinstance(node, list) and isinstance(key, str) and key.isdigit():
            key = int(key)
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"--field {path!r}: no {key!r} under {rest[:pos] or '$'!r}") from None
        pos = m.end()
    return node


def parse_sample(stdout: str, field: str | None) -> float:
    """One number from a command's stdout: the last non-empty line, or ``field`` of the JSON it printed."""
    lines = [ln.strip() for ln in stdout.splitlines() if ln.strip()]
    if not lines:
        raise ValueError("printed nothing on stdout")
    if field is None:
        try:
            value = float(lines[-1])
        except ValueError:
            raise ValueError(f"last line of stdout is not a number: {lines[-1][:200]!r}") from None
    else:
        try:
            doc = json.loads(stdout)
        except json.JSONDecodeError:
            try:  # commands that log first and print their JSON last
                doc = json.loads(lines[-1])
            except json.JSONDecodeError:
                raise ValueError(f"neither stdout nor its last line is JSON: {lines[-1][:200]!r}") from None
        raw = json_field(doc, field)
        if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
            raise ValueError(f"--field {field!r} is {raw!r}, not a number")
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"--field {field!r} is {raw!r}, not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"sample {value} is not finite")
    return value


def _tail(text: str, n: int = 800) -> str:
    text = text.strip()
    return text if len(text) <= n else "…" + text[-n:]


def shell_measure(label: str, cmd: str, field: str | None, wall_time: bool, timeout: float):
    """A ``measure`` that runs ``cmd`` through the shell once and returns its sample."""
    def measure() -> float:
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise CommandError(f"arm {label}: `{cmd}` ran past --timeout {timeout:g} s") from None
        elapsed = time.perf_counter() - t0
        if p.returncode != 0:
            raise CommandError(f"arm {label}: `{cmd}` exited with {p.returncode}; stderr: {_tail(p.stderr)!r}")
        if wall_time:
            return elapsed
        try:
            return parse_sample(p.stdout, field)
        except ValueError as e:
            raise CommandError(f"arm {label}: `{cmd}` {e}") from None
    return measure


class Service:
    """A background command (a server an arm talks to), in its own process group so stop() ends all of it."""

    def __init__(self, label: str, cmd: str, ready: str | None, ready_timeout: float):
        self.label, self.cmd, self.ready, self.ready_timeout = label, cmd, ready, ready_timeout
        self.proc: subprocess.Popen | None = None
        self.log = None
        self.starts = 0

    def start(self) -> None:
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(self.cmd, shell=True, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.starts += 1
        deadline = time.monotonic() + self.ready_timeout
        while True:
            if self.proc.poll() is not None:
                output, code = self._output(), self.proc.returncode
                self.stop()
                raise CommandError(f"arm {self.label}: setup `{self.cmd}` exited with {code} "
                                   f"before it was ready; output: {output!r}")
            if self.ready is None or subprocess.run(self.ready, shell=True, capture_output=True).returncode == 0:
                return
            if time.monotonic() > deadline:
                self.stop()
                raise CommandError(f"arm {self.label}: `{self.ready}` did not succeed within "
                                   f"--ready-timeout {self.ready_timeout:g} s after starting `{self.cmd}`")
            time.sleep(0.2)

    def _output(self) -> str:
        self.log.seek(0)
        return _tail(self.log.read())

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(self.proc.pid, sig)  # the group this service's own Popen created
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self.proc = None
        self.log.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--a", required=True, metavar="CMD", help="arm A (the baseline): a shell command")
    p.add_argument("--b", required=True, metavar="CMD", help="arm B: a shell command")
    p.add_argument("--repeats", type=int, default=10, metavar="N", help="recorded runs per arm (default 10)")
    p.add_argument("--order", choices=ORDERS, default="abba", help="abba (default) cancels linear drift")
    p.add_argument("--warmup", type=int, default=1, metavar="K", help="unrecorded runs per arm (default 1)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--field", metavar="JSONPATH", help="read this field of the JSON on stdout (e.g. $.tok_s)")
    what.add_argument("--wall-time", action="store_true", help="the sample is the command's wall time (s)")
    p.add_argument("--higher-is-better", action="store_true",
                   help="samples are throughputs (default: lower is better, as for times)")
    p.add_argument("--no-aa", action="store_true", help="skip the A/A control (not recommended)")
    p.add_argument("--restart", action="store_true",
                   help="restart the setup service before every block of consecutive same-arm runs")
    p.add_argument("--a-setup", metavar="CMD", help="background service for arm A (and its A/A copy)")
    p.add_argument("--b-setup", metavar="CMD", help="background service for arm B")
    p.add_argument("--a-ready", metavar="CMD", help="polled until it exits 0 after A's setup starts")
    p.add_argument("--b-ready", metavar="CMD", help="polled until it exits 0 after B's setup starts")
    p.add_argument("--ready-timeout", type=float, default=300.0, metavar="S")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S", help="limit per command run")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    p.add_argument("--boot", type=int, default=10_000, metavar="N", help="bootstrap resamples")
    p.add_argument("--out", metavar="FILE", help="result JSON (default: a fresh file in a temporary directory)")
    p.add_argument("--plot", metavar="FILE", help="PNG of samples per arm in run order")
    p.add_argument("--quiet", action="store_true", help="no per-run progress on stderr")


def _arm(label: str, cmd: str, setup: str | None, ready: str | None, args) -> Arm:
    service = Service(label, setup, ready, args.ready_timeout) if setup else None
    measure = shell_measure(label, cmd, args.field, args.wall_time, args.timeout)
    return Arm(cmd, measure, service.start if service else None, service.stop if service else None)


def run(args) -> int:
    from engram.bench import report, stats

    if args.restart and not (args.a_setup or args.b_setup):
        print("engram bench ab: --restart needs --a-setup or --b-setup (each run of a plain command is "
              "already a fresh process)", file=sys.stderr)
        return 2
    if (args.a_ready and not args.a_setup) or (args.b_ready and not args.b_setup):
        print("engram bench ab: --a-ready/--b-ready need the matching --a-setup/--b-setup", file=sys.stderr)
        return 2
    try:
        cfg = ABConfig(repeats=args.repeats, order=args.order, warmup=args.warmup, restart=args.restart,
                       aa=not args.no_aa, higher_is_better=args.higher_is_better, n_boot=args.boot,
                       seed=args.seed)
    except ValueError as e:
        print(f"engram bench ab: {e}", file=sys.stderr)
        return 2
    arm_a = _arm("A", args.a, args.a_setup, args.a_ready, args)
    arm_b = _arm("B", args.b, args.b_setup, args.b_ready, args)
    total = len(stats.arm_labels(cfg.aa)) * cfg.repeats

    def progress(r: Run) -> None:
        if not args.quiet:
            what = "warm-up" if r.round < 0 else f"round {r.round}"
            print(f"[{r.index + 1:4d}] {r.arm:2s} {what:9s} {r.value:.6g}   ({total} recorded runs)",
                  file=sys.stderr, flush=True)

    try:
        result = stats.run_interleaved(arm_a, arm_b, cfg, on_run=progress)
    except (CommandError, ValueError) as e:
        print(f"engram bench ab: {e}", file=sys.stderr)
        return 1
    config = {"a": args.a, "b": args.b, "field": args.field, "wall_time": args.wall_time,
              "a_setup": args.a_setup, "b_setup": args.b_setup, "a_ready": args.a_ready, "b_ready": args.b_ready}
    path = report.write_result("ab", config, result.to_dict(), out=args.out)
    print(result.table())
    if args.plot:
        stats.plot_runs(result, args.plot, title=f"A: {args.a}\nB: {args.b}"[:200])
        print(f"plot: {args.plot}")
    print(f"result: {path}")
    return 0
