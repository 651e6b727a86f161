"""The memory a server's process tree holds on the node (Linux, from /proc), and how much of it is the Engram tables'
shared copy (store/shared_host.py): what ``engram bench serve`` reports as ``node_memory`` for the server it started,
and what the shared-table tests measure.

Definitions (every size in bytes; a page mapped by k processes counts 1/k to each one's Pss, wholly to each one's Rss):

- the **tree** of a pid: the pid and all its descendants that are alive (zombies are left out), found through
  ``/proc/<pid>/task/*/children`` (else, on kernels without it, the ppid field of every ``/proc/*/stat``); a
  process that exits while the tree or its memory is being read is skipped;
- a process's **total Pss**: the ``Pss:`` line of ``/proc/<pid>/smaps_rollup`` (the sum over ``smaps`` where there
  is no rollup): anonymous, file, shared memory and pinned host memory alike;
- a process's **mappings of a directory**: per file under that directory, the Pss and Rss of the process's mappings
  of it (``/proc/<pid>/smaps``; a file unlinked while mapped counts under its name);
- the **shared tables**: the mappings of engram's table segments, the files ``engram-<key>-<part>`` directly in the
  shm directory (lock and ``.tmp-*`` files are not segments; no other file of the directory counts);
- **one copy** of the tables: the sizes of the segment files now in the shm directory that a process of the tree
  maps (a segment another server or a dead process left there, which the tree does not map, is not counted).

``node_memory(pid, shm_dir)`` puts them together; ``shared_tables_pss_over_one_copy`` (the tree's Pss of the shared
tables ÷ one copy) is at most 1 when the tree maps one shared copy (exactly 1 once every page is mapped, as CUDA's
registration of the segments does; a little more for small files, whose partial last page counts whole: 1.005 for
tiny's two 0.5 MB tables) and about M when M processes each hold a private copy of the segments' pages.
M copies made as M segments of their own would multiply ``segments`` and ``one_copy_bytes`` instead: compare those
with the tables' size (one engine's ``one_copy_bytes``).
Reading ``smaps`` walks every page table of the process (and stalls its memory map meanwhile), so the bench samples it
once, after its measured window."""
from __future__ import annotations

import json
import os
import re
import shlex
from collections import deque
from pathlib import Path

DEFAULT_SHM_DIR = "/dev/shm"  # engram_config.advanced.shm_dir's default (store/options.py)
_MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \d+ *(.*)$")  # a mapping's first line in smaps
_DELETED = " (deleted)"


def _read(path: str | Path) -> str | None:
    """The text of a /proc file, or None when its process is gone (or its files cannot be read)."""
    try:
        return Path(path).read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) from /proc/<pid>/stat, or None when the process is gone."""
    text = _read(f"/proc/{pid}/stat")
    if not text:
        return None
    fields = text.rpartition(")")[2].split()  # after the command name, which may hold spaces and parentheses
    return fields[0], int(fields[1])


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def _children_of_tasks(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except (FileNotFoundError, ProcessLookupError):
        return out
    for task in tasks:
        out += [int(c) for c in (_read(task / "children") or "").split()]
    return out


def _children_by_ppid() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (st := _stat(int(d.name))) is not None:
            out.setdefault(st[1], []).append(int(d.name))
    return out


def process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants, ``pid`` first, then breadth-first (each process's children ascending);
    [] when ``pid`` is not alive."""
    if not _alive(pid):
        return []
    by_ppid = None if Path(f"/proc/{pid}/task/{pid}/children").exists() else _children_by_ppid()
    out, seen, todo = [], {pid}, deque([pid])
    while todo:
        p = todo.popleft()
        if not _alive(p):
            continue
        out.append(p)
        for c in sorted(_children_of_tasks(p) if by_ppid is None else by_ppid.get(p, [])):
            if c not in seen:
                seen.add(c)
                todo.append(c)
    return out


def total_pss(pid: int) -> int | None:
    """Process ``pid``'s total Pss in bytes (smaps_rollup; summed over smaps without one), None when it is gone."""
    rollup = _read(f"/proc/{pid}/smaps_rollup")
    text = rollup if rollup is not None else _read(f"/proc/{pid}/smaps")
    if text is None:
        return None
    return sum(int(line.split()[1]) * 1024 for line in text.splitlines() if line.startswith("Pss:"))


def file_mappings(pid: int, directory: str | Path) -> dict[str, tuple[int, int]] | None:
    """{path: (Pss, Rss)} in bytes of process ``pid``'s mappings of the files under ``directory`` (every mapping of a
    file summed; a file unlinked while mapped under its path), from /proc/<pid>/smaps; None when it is gone."""
    text = _read(f"/proc/{pid}/smaps")
    if text is None:
        return None
    prefix = os.path.realpath(directory).rstrip("/") + "/"  # smaps names the resolved path
    out: dict[str, tuple[int, int]] = {}
    path = None
    for line in text.splitlines():
        m = _MAPPING.match(line)
        if m:
            name = m.group(1).removesuffix(_DELETED)
            path = name if name.startswith(prefix) else None
        elif path is not None and line.startswith(("Pss:", "Rss:")):
            pss, rss = out.get(path, (0, 0))
            kb = int(line.split()[1]) * 1024
            out[path] = (pss + kb, rss) if line.startswith("Pss:") else (pss, rss + kb)
    return out


def mapped_memory(pid: int, directory: str | Path) -> tuple[int, int] | None:
    """(Pss, Rss) in bytes of ``pid``'s mappings of the files under ``directory`` together; None when it is gone."""
    maps = file_mappings(pid, directory)
    return None if maps is None else (sum(m[0] for m in maps.values()), sum(m[1] for m in maps.values()))


def is_segment(path: str | Path) -> bool:
    """Whether ``path``'s name is a table segment's (``engram-<key>-<part>``, shared_host.segment_path)."""
    from engram.store.shared_host import PARTS

    return re.fullmatch(rf"engram-[0-9a-f]+-(?:{'|'.join(PARTS)})", Path(path).name) is not None


def segment_sizes(shm_dir: str | Path) -> dict[str, int]:
    """{resolved path: bytes} of the table segments now in ``shm_dir`` ({} when it is not a directory)."""
    root = Path(os.path.realpath(shm_dir))
    try:
        entries = list(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return {}
    out = {}
    for p in entries:
        try:
            if is_segment(p) and p.is_file():
                out[str(p)] = p.stat().st_size
        except FileNotFoundError:  # unlinked meanwhile (its last mapper let go)
            pass
    return out


def node_memory(pid: int, shm_dir: str | Path = DEFAULT_SHM_DIR) -> dict:
    """The memory process ``pid``'s tree holds (the module's definitions): ``pids`` (the tree, as measured),
    ``processes`` (their count), ``pss_total_bytes`` (their total Pss), ``shm_dir``, ``segments`` (how many segment
    files the tree maps), ``one_copy_bytes`` (their sizes), ``shared_tables_pss_bytes`` (the tree's Pss of segment
    mappings), ``shared_tables_rss_bytes_per_process`` (each process's Rss of them, in ``pids``' order) and
    ``shared_tables_pss_over_one_copy`` (None when ``one_copy_bytes`` is 0). {"skipped": reason} without /proc or
    when ``pid`` is not running."""
    if not Path("/proc/self/smaps").exists():
        return {"skipped": "no /proc/<pid>/smaps: the node's memory is measured on Linux only"}
    tree = process_tree(pid)
    if not tree:
        return {"skipped": f"process {pid} is not running"}
    root = os.path.realpath(shm_dir)
    rows = []
    for p in tree:
        maps, total = file_mappings(p, root), total_pss(p)
        if maps is not None and total is not None:  # else it exited meanwhile
            rows.append((p, total, {k: v for k, v in maps.items()
                                    if os.path.dirname(k) == root and is_segment(k)}))
    if not rows:
        return {"skipped": f"process {pid} exited while it was measured"}
    sizes = segment_sizes(root)
    mapped = {k for _, _, m in rows for k in m if k in sizes}
    one_copy = sum(sizes[k] for k in mapped)
    shared_pss = sum(pss for _, _, m in rows for pss, _ in m.values())
    return {"pids": [p for p, _, _ in rows], "processes": len(rows), "pss_total_bytes": sum(t for _, t, _ in rows),
            "shm_dir": root, "segments": len(mapped), "one_copy_bytes": one_copy,
            "shared_tables_pss_bytes": shared_pss,
            "shared_tables_rss_bytes_per_process": [sum(rss for _, rss in m.values()) for _, _, m in rows],
            "shared_tables_pss_over_one_copy": shared_pss / one_copy if one_copy else None}


def shm_dir_of(serve_args: str) -> str:
    """engram_config.advanced.shm_dir of an ``engram serve`` command line's ``--engram-config`` JSON (the last one
    given, as argparse takes it), else the default; ValueError when that JSON is not an object."""
    words, text = shlex.split(serve_args), None
    for i, w in enumerate(words):
        if w == "--engram-config" and i + 1 < len(words):
            text = words[i + 1]
        elif w.startswith("--engram-config="):
            text = w.partition("=")[2]
    config = json.loads(text) if text else {}
    if not isinstance(config, dict) or not isinstance(config.get("advanced") or {}, dict):
        raise ValueError(f"--engram-config {text!r} is not a JSON object of options")
    return (config.get("advanced") or {}).get("shm_dir") or DEFAULT_SHM_DIR


def bench_server_memory(pid: int | None, serve_args: str) -> dict:
    """``engram bench serve``'s ``node_memory``: node_memory of the server it started (``pid``), in the shm directory
    its ``--serve-args`` give; {"skipped": reason} for a server it did not start (``--url``: ``pid`` None) or when it
    cannot be measured. Never raises: the measurement must not fail the bench."""
    if pid is None:
        return {"skipped": "--url: not this bench's server"}
    try:
        return node_memory(pid, shm_dir_of(serve_args))
    except (OSError, ValueError) as e:
        return {"skipped": f"{type(e).__name__}: {e}"}


def summary_line(doc: dict) -> str:
    """One line of ``node_memory``'s result for the bench's tables."""
    from engram.store.sizes import fmt_bytes

    if "skipped" in doc:
        return f"node memory: skipped ({doc['skipped']})"
    ratio, b = doc["shared_tables_pss_over_one_copy"], fmt_bytes
    rss = " ".join(b(r) for r in doc["shared_tables_rss_bytes_per_process"] if r) or "-"
    return (f"node memory of the server's {doc['processes']} processes: Pss {b(doc['pss_total_bytes'])}; shared tables "
            f"({doc['segments']} segments in {doc['shm_dir']}): Pss {b(doc['shared_tables_pss_bytes'])} = "
            + ("-" if ratio is None else f"{ratio:.3f}") + f" x one copy ({b(doc['one_copy_bytes'])}); Rss of each "
            f"process mapping them: {rss}")
