"""The step loop of pipeline parallelism (``MicrobatchPipeline``, a ``StepPipeline``): up to ``depth`` steps (the
number of stages) in flight at once, so that while the last stage computes one microbatch the first computes the next
(vLLM's virtual engines). Each step is a microbatch of at most ``ceil(max_num_seqs / depth)`` sequences (so the
running ones spread over the microbatches) with no token in flight: a sequence whose sampled
token of an earlier step is not read yet sits out until it is, so no step waits on another's output; prompt chunks
without a sampled token may follow each other in consecutive microbatches, as every stage runs microbatches in launch
order (a chunk's KV is written on each stage before the next chunk reads it there). Steps are collected oldest first.

Where the executor's stages relay sampled ids among themselves (``relays_sampled_ids``: parallel/pp_relay.py), a step
that no other microbatch can fill takes the oldest step's sequences with their tokens in flight (those not certainly
finished by them): it is launched before the oldest is read, and the stages patch the relayed tokens in as they
arrive, so the microbatch goes on without a round trip through the engine (one more step is then in flight).

Each microbatch is its own step on the Workers: its own description, its own staged Engram rows (tagged with its step
id, passed through its decoder call, never shared), its own lookups. A step that fails is handled as the synchronous
loop does: the steps launched after it are read and dropped (nothing of them is committed), and its sequences run
again, failures isolated (``StepError``)."""
from __future__ import annotations

import functools
import logging
from collections import deque

from engram.engine.outputs import RequestOutput
from engram.engine.scheduler import ScheduledBatch
from engram.engine.sequence import Sequence
from engram.engine.stepping import Launched, StepPipeline, pick

log = logging.getLogger(__name__)


class MicrobatchPipeline(StepPipeline):
    """``StepPipeline`` with ``depth`` microbatches in flight (see the module docstring)."""

    def __init__(self, *args, depth: int, **kwargs):
        super().__init__(*args, **kwargs)
        if depth < 1:
            raise ValueError(f"microbatch depth={depth}: must be >= 1")
        self.depth = depth
        # sequences of one microbatch, at most: each stage's share of max_num_seqs, so decodes spread over them
        self.share = -(-self.config.max_num_seqs // depth)
        self._flight: deque[Launched] = deque()  # launched, not collected; oldest first
        self.max_in_flight = 0  # the most steps that were in flight at once (stats, tests)
        # Decided once: the stages relay sampled ids among themselves (parallel/pp_relay.py), so a sequence whose
        # token is in flight in the oldest step may go on in the next one, before the engine reads that token
        self.relay = bool(getattr(self.executor, "relays_sampled_ids", False))

    @property
    def in_flight(self) -> Launched | None:
        return self._flight[0] if self._flight else None

    @property
    def num_in_flight(self) -> int:
        return len(self._flight)

    def drop_orphaned(self) -> None:
        """Read the oldest steps in flight while every request in them is gone (aborted); their tokens are dropped."""
        while self._flight and all(seq.is_finished for seq in self._flight[0].batch.seqs):
            gone = self._flight.popleft()
            try:
                self._collect(gone)
            except Exception as e:
                log.warning("a step whose requests were all aborted failed: %s: %s", type(e).__name__, e)

    def step(self) -> list[RequestOutput]:
        """Launch the next microbatch; once ``depth`` are in flight (or nothing is left to launch), read the oldest ->
        its outputs."""
        prev = None
        batch = self.scheduler.schedule(hold=functools.partial(self._sits_out, None), max_seqs=self.share)
        self.num_preemptions += len(batch.preempted)
        if batch.is_empty and self.relay and self._flight:  # no other microbatch to form: the oldest's sequences go
            prev = self._flight[0]  # on with their tokens in flight (the stages relay them)
            batch = self.scheduler.schedule(hold=functools.partial(self._sits_out, prev), max_seqs=self.share)
            self.num_preemptions += len(batch.preempted)
        if not batch.is_empty:
            try:
                self._flight.append(self._launch(batch, prev))
            except Exception as e:  # nothing of it was committed: read what is in flight, then run it alone
                log.warning("launching microbatch step %d failed (%s: %s): reading the steps in flight, then "
                            "running it synchronously", self.num_steps, type(e).__name__, e)
                outputs = self._drain()
                return outputs + self._run_or_fold(_live(batch), outputs)
            self.max_in_flight = max(self.max_in_flight, len(self._flight))
            if len(self._flight) < self.depth + self.relay:  # relaying: the next microbatch goes in before a read
                return []
        return self._collect_oldest() if self._flight else []

    def _drain(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        while self._flight:
            outputs += self._collect_oldest()
        return outputs

    def _collect_oldest(self) -> list[RequestOutput]:
        """Read the oldest step; on failure read and drop every later one, then re-run its batch isolating failures."""
        launched = self._flight.popleft()
        try:
            return self._collect(launched)
        except Exception as e:
            log.warning("step %d failed (%s: %s): the %d step(s) after it are dropped, its sequences run again, "
                        "isolated", launched.step_id, type(e).__name__, e, len(self._flight))
            while self._flight:
                dropped = self._flight.popleft()
                try:
                    self.executor.collect(dropped.handle)
                except Exception:
                    pass  # whatever it did is discarded with it
                self._rollback(dropped)
            live = [i for i, (seq, epoch) in enumerate(zip(launched.batch.seqs, launched.epochs))
                    if not seq.is_finished and seq.metrics.num_preemptions == epoch]
            return self._run_isolated(pick(launched.batch, live))


    def _sits_out(self, prev: Launched | None, seq: Sequence) -> bool:
        """A sequence sits out while a token it sampled is not read yet (its next step needs that token), unless the
        token is ``prev``'s (the oldest step in flight, whose ids the stages relay) and not certainly its last."""
        if not seq.num_pending:
            return False
        return (prev is None or seq.num_pending > 1 or seq.seq_id not in prev.sample_index
                or self._last_token_in_flight(seq))


def _live(batch: ScheduledBatch) -> ScheduledBatch:
    return pick(batch, [i for i, seq in enumerate(batch.seqs) if not seq.is_finished])
