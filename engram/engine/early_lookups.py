"""A pipeline stage's lookups started as soon as the stage learns of a step (``EarlyLookups``), not when it takes it:
``start(step, patch)`` stages the step's prompt ranges (the Worker's ``PrefetchStaging.accept``) and submits its Engram
lookups at once (``patch``: its tokens in flight, once they are on this stage), while the stage may still compute an
earlier microbatch; the runner's ``submit(step)`` of that step then gets exactly those ``StagedRows`` (tagged with the
step id, handed out once), any other step is submitted as before. Each started step keeps its own rows, so a lookup
started early for one microbatch never writes into another's. A failed start is raised by that step's own ``submit``,
never by the step that was running when it began.

It wraps the Worker's lookup executor (a ``Worker(wrap_lookup=...)``) and is otherwise transparent: every other
attribute is the wrapped executor's, and ``staging`` is set through to it."""
from __future__ import annotations

from engram.engine.step import StepDescription

__all__ = ["EarlyLookups"]


class EarlyLookups:
    """``inner``: the lookup executor (or a wrapper of it); ``limit``: how many started steps may wait for their
    launch at once (a stage sees at most the engine's microbatches in flight; more means steps are started and never
    launched, and ``start`` raises naming them)."""

    def __init__(self, inner, limit: int):
        if limit < 1:
            raise ValueError(f"EarlyLookups limit={limit}: must be >= 1")
        self.__dict__["inner"] = inner  # set first: every other attribute is looked up on it
        self.limit = limit
        # step id -> (StagedRows, or the exception its start raised; whether started with a pending-token patch)
        self._started: dict[int, tuple[object, bool]] = {}
        # steps started early and consumed by their launch / submitted at launch (not started before)
        self.counts = {"started_early": 0, "submitted_at_launch": 0}

    @staticmethod
    def can_start(step: StepDescription, patch=None) -> bool:
        """Whether ``step``'s row ids are all known: in its description, or its tokens in flight are here as
        ``patch`` (PendingTokens.patch); and no drafts (a draft model's patch is made at launch)."""
        return (not step.pending_rows or patch is not None) and step.draft is None and not step.num_drafts

    def start(self, step: StepDescription, patch=None) -> None:
        """Stage ``step``'s prompt ranges and submit its lookups now, ``patch``: its tokens in flight (once per step;
        a step that ``can_start`` says no to is left to its launch)."""
        if step.step_id in self._started or not self.can_start(step, patch):
            return
        if len(self._started) >= self.limit:
            raise RuntimeError(f"step {step.step_id}: {len(self._started)} steps' lookups were started and not "
                               f"launched yet (steps {sorted(self._started)}, limit {self.limit})")
        try:
            self.inner.staging.accept(step)  # the prompt ranges first: the lookups' staged uses read them
            self._started[step.step_id] = (self.inner.submit(step, patch), patch is not None)
        except Exception as e:  # the step's own launch raises it
            self._started[step.step_id] = (e, patch is not None)

    def submit(self, step: StepDescription, patch=None, **kwargs):
        """The rows ``start`` staged for ``step`` (handed out once), else the wrapped executor's ``submit``."""
        started = self._started.pop(step.step_id, None)
        if started is None:
            self.counts["submitted_at_launch"] += 1
            return self.inner.submit(step, patch, **kwargs)
        staged, patched = started
        if isinstance(staged, Exception):
            raise staged
        if (patch is not None) != patched or kwargs:  # the same tokens in flight both times: the Worker's
            staged.release()
            raise RuntimeError(f"step {step.step_id}: its lookups were started early "
                               f"{'with' if patched else 'without'} a pending-token patch, but its launch asks "
                               f"{'for ' + str(sorted(kwargs)) if kwargs else 'otherwise'}")
        self.counts["started_early"] += 1
        return staged

    @property
    def pending(self) -> list[int]:
        """Step ids started and not launched yet, oldest first."""
        return list(self._started)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value) -> None:
        if name == "staging":  # the Worker hands its PrefetchStaging to the executor that reads it
            setattr(self.inner, name, value)
        else:
            object.__setattr__(self, name, value)
