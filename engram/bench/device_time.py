"""Device busy time of a piece of code, from torch.profiler: ``measure_busy(fn, device_type)`` is the union of the
device's work intervals while ``fn`` ran (CUDA kernels, memcpys, memsets, overlaps once, waits excluded; on "cpu" torch
operators); ``measure_profile`` adds it by kernel name. Wall time is timed separately."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

# kineto activity types of GPU work (not "cuda_sync" waits, not "gpu_user_annotation" copies of profiler ranges)
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by [start, end) intervals (overlaps counted once); empty intervals add nothing."""
    total, reach = 0.0, None
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def busy_intervals_ns(events, device_type: str) -> list[tuple[int, int]]:
    """(start, end) in nanoseconds of every kineto event that is work on ``device_type`` ("cuda" | "cpu")."""
    from torch.autograd import DeviceType

    out = []
    for evt in events:
        if device_type == "cuda":
            if evt.device_type() != DeviceType.CUDA or _activity(evt) not in DEVICE_WORK:
                continue
        elif evt.device_type() != DeviceType.CPU or _activity(evt) != "cpu_op":
            continue
        out.append((evt.start_ns(), evt.end_ns()))
    return out


def _activity(evt) -> str:
    """An event's kineto activity type (torch < 2.12: work unless named a synchronization wait)."""
    if hasattr(evt, "activity_type"):
        return evt.activity_type()
    from torch.autograd import DeviceType

    if evt.device_type() == DeviceType.CUDA:
        return "cuda_sync" if "Sync" in evt.name() else "kernel"
    return "cpu_op"


@dataclass
class KernelTime:
    """Device work of one kernel name (or copy / memset) in a profile."""

    name: str
    calls: int
    seconds: float


@dataclass
class BusyProfile:
    busy_s: float  # union of the device work intervals
    kernels: list[KernelTime] = field(default_factory=list)  # grouped by name, most time first


def kernel_times(events, device_type: str) -> list[KernelTime]:
    """Device work of ``events`` grouped by name: calls and summed seconds, largest total first."""
    from torch.autograd import DeviceType

    want = DeviceType.CUDA if device_type == "cuda" else DeviceType.CPU
    groups: dict[str, list] = {}
    for evt in events:
        if evt.device_type() != want or _activity(evt) not in (DEVICE_WORK if device_type == "cuda" else ("cpu_op",)):
            continue
        g = groups.setdefault(evt.name(), [0, 0])
        g[0] += 1
        g[1] += max(0, evt.end_ns() - evt.start_ns())
    return sorted((KernelTime(n, c, ns / 1e9) for n, (c, ns) in groups.items()), key=lambda k: -k.seconds)


def cuda_kernels(events) -> list[tuple[int, int, int, str]]:
    """(start ns, end ns, stream id, name) of every CUDA kernel among ``events``, in start order."""
    from torch.autograd import DeviceType

    out = [(e.start_ns(), e.end_ns(), e.device_resource_id(), e.name()) for e in events
           if e.device_type() == DeviceType.CUDA and _activity(e) == "kernel"
           and "Memcpy" not in e.name() and "Memset" not in e.name()]
    return sorted(out)


def measure_busy(fn: Callable[[], object], device_type: str) -> float:
    """Seconds ``device_type`` was busy while ``fn()`` ran; RuntimeError when the profile saw no such event at all."""
    return measure_profile(fn, device_type).busy_s


def measure_profile(fn: Callable[[], object], device_type: str) -> BusyProfile:
    """``measure_busy`` plus the device work grouped by kernel name (``BusyProfile``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type={device_type!r}: must be 'cuda' or 'cpu'")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
    if device_type == "cuda":
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        fn()
        if device_type == "cuda":
            torch.cuda.synchronize()
    events = prof.profiler.kineto_results.events()
    intervals = busy_intervals_ns(events, device_type)
    if not intervals:
        raise RuntimeError(f"torch.profiler recorded no {device_type} work while the measured code ran")
    return BusyProfile(union_length(intervals) / 1e9, kernel_times(events, device_type))
