"""Shared output of every ``engram bench`` command: one JSON file per run and a readable table. ``write_result`` stores
``{"name", "date", "git", "machine", "config", "result"}`` at ``--out``, else under ``<tmp>/engram-bench/`` (never into
the working tree by default); ``format_table`` renders rows of dicts."""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from engram import envs

RESULTS_DIR = Path(tempfile.gettempdir()) / "engram-bench"  # where a run without --out goes
_SOURCE_DIR = Path(__file__).resolve().parent


def git_commit(cwd: str | os.PathLike | None = None) -> dict[str, Any]:
    """{"commit", "dirty"} of the source tree. ``ENGRAM_COMMIT``, when set, names the commit and wins over git (a
    copied tree may carry a stale ``.git`` whose HEAD is not the source that ran: "dirty" is then None)."""
    if envs.commit():
        return {"commit": envs.commit(), "dirty": None}
    where = str(cwd or _SOURCE_DIR)
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):  # not a checkout, or no git binary
        return {"commit": envs.commit(), "dirty": None}
    return {"commit": sha, "dirty": bool(status.strip())}


def machine_info() -> dict[str, Any]:
    """Host, CPU and Python facts; torch and its CUDA devices only when the bench already imported torch."""
    info: dict[str, Any] = {
        "host": platform.node(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }
    torch = sys.modules.get("torch")  # importing torch here would cost seconds for benches that never use it
    if torch is not None:
        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["cuda"] = torch.version.cuda
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def result_path(name: str, results_dir: str | os.PathLike | None = None, now: _dt.datetime | None = None) -> Path:
    """A fresh ``<results_dir>/<YYYY-mm-dd-HHMMSS>-<name>.json``; a suffix keeps two runs in one second apart."""
    if not name or any(c in name for c in "/\\") or name.startswith("."):
        raise ValueError(f"result name={name!r} must be a plain, non-empty file name part")
    stamp = (now or _dt.datetime.now(_dt.timezone.utc)).strftime("%Y-%m-%d-%H%M%S")
    base = Path(results_dir or RESULTS_DIR)
    path, k = base / f"{stamp}-{name}.json", 1
    while path.exists():
        path, k = base / f"{stamp}-{name}-{k}.json", k + 1
    return path


def args_config(args: Any) -> dict[str, Any]:
    """A bench's argparse namespace as its result's ``config``, without private or callable entries."""
    return {k: v for k, v in vars(args).items() if not k.startswith("_") and not callable(v)}


def write_result(name: str, config: dict[str, Any], result: dict[str, Any], out: str | os.PathLike | None = None,
                 results_dir: str | os.PathLike | None = None) -> Path:
    """Write one run as JSON (to ``out`` if given, else a fresh file under ``results_dir``); return its path."""
    now = _dt.datetime.now(_dt.timezone.utc)
    path = Path(out) if out is not None else result_path(name, results_dir, now)
    doc = {"name": name, "date": now.isoformat(timespec="seconds"), "git": git_commit(),
           "machine": machine_info(), "config": config, "result": result}
    text = json.dumps(doc, indent=2, allow_nan=False, default=_jsonable)  # fails before anything is written
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n")
    tmp.replace(path)  # a reader never sees half a file
    return path


def _jsonable(x: Any) -> Any:
    if hasattr(x, "tolist"):  # numpy scalars and arrays, torch tensors
        return x.tolist()
    if isinstance(x, os.PathLike):
        return os.fspath(x)
    raise TypeError(f"bench result holds a {type(x).__name__}, which JSON cannot store: {x!r}")


def _cell(v: Any, floatfmt: str) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else floatfmt.format(v)
    return "" if v is None else str(v)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None,
                 floatfmt: str = "{:.4g}") -> str:
    """Rows of dicts as an aligned text table; ``columns`` picks and orders them (default: first-seen order)."""
    if columns is None:
        columns = list(dict.fromkeys(k for row in rows for k in row))
    cells = [[_cell(row.get(c), floatfmt) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]

    def line(parts: Sequence[str]) -> str:
        # numbers right-aligned, text left-aligned, so columns of figures line up on their last digit
        return "  ".join(p.rjust(w) if _is_number(p) else p.ljust(w) for p, w in zip(parts, widths)).rstrip()

    out = [line(list(columns)), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    return "\n".join(out)


def _is_number(s: str) -> bool:
    try:
        float(s.rstrip("%"))
    except ValueError:
        return False
    return True
