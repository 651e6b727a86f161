"""Executor: how the engine reaches its Workers. One method per direction, nothing model-specific.
``execute(step) -> StepResult`` (rank 0's), split into ``launch`` and ``collect`` for async scheduling;
``takes_pending_tokens()`` says whether the Workers accept steps whose inputs are still on the device; ``stats()``
gathers the Workers' counters. ``UniProcExecutor`` calls one in-process Worker directly. ``ExecutorFailed``: raised
when the Workers are gone for good."""
from __future__ import annotations

from typing import Any

from engram.engine.step import StepDescription, StepResult
from engram.engine.worker import Worker


class ExecutorFailed(RuntimeError):
    """The executor can run no more steps (a Worker process died): whoever drives the engine should fail every
    request in flight and stop, not retry (the server exits non-zero)."""


def executor_failed(error: BaseException | None) -> bool:
    """Whether ``error`` is, or was raised from, an ExecutorFailed."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, ExecutorFailed):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


class Executor:
    """The engine's view of its Workers."""

    num_kv_blocks: int  # KV blocks every Worker allocated (the scheduler's block pool)

    def execute(self, step: StepDescription) -> StepResult:
        return self.collect(self.launch(step))

    def launch(self, step: StepDescription) -> Any:
        """Start a step on every Worker; returns a handle for ``collect``, without waiting for the device."""
        raise NotImplementedError

    def collect(self, handle: Any) -> StepResult:
        """Wait for a launched step (launches are collected in order) -> rank 0's StepResult."""
        raise NotImplementedError

    def takes_pending_tokens(self) -> bool:
        return False

    def stats(self) -> dict[str, Any]:
        raise NotImplementedError


class UniProcExecutor(Executor):
    """One Worker, in the engine's process."""

    def __init__(self, worker: Worker):
        self.worker = worker
        self.num_kv_blocks = worker.memory.num_blocks

    def launch(self, step: StepDescription) -> Any:
        return self.worker.launch(step)

    def collect(self, handle: Any) -> StepResult:
        return self.worker.collect(handle)

    def takes_pending_tokens(self) -> bool:
        return self.worker.takes_pending_tokens()

    def stats(self) -> dict[str, Any]:
        return self.worker.stats()
