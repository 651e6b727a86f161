"""Sequence: one request's tokens, its KV blocks, its Engram state and its progress through the engine. ``token_ids``:
prompt + generated tokens the engine has read; ``num_pending`` more were sampled by steps in flight (at most two, on the
device only) and the scheduler counts them. ``num_computed_tokens`` have K/V in the cache (or will, once launched steps
run). Preemption by recompute drops the blocks; everything is rebuilt from the tokens when the sequence runs again,
after whatever prefix of them the prefix cache still holds."""
from __future__ import annotations

import enum
import time
from typing import Any

import torch

from engram.engine.detokenizer import IncrementalDetokenizer
from engram.engine.outputs import RequestMetrics
from engram.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV blocks; prefilling in chunks or decoding
    FINISHED = "finished"


class Sequence:
    def __init__(self, seq_id: int, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 prompt_compressed: list[int], params: SamplingParams, detokenizer: IncrementalDetokenizer,
                 initial_lookback: torch.Tensor):
        self.seq_id = seq_id  # engine-wide order of arrival (the scheduler's priority)
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.prompt_token_ids: list[int] = list(prompt_token_ids)  # every RequestOutput shares this list
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + generated (raw ids)
        self.compressed_ids: list[int] = list(prompt_compressed)  # same length, compressed (DEAD = -1)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.block_table: list[int] = []  # KV block ids, in token order
        self.block_keys: list[bytes] = []  # prefix-cache key of each full block of known tokens (prefix_cache.py)
        self.num_cached_tokens = 0  # tokens taken from the prefix cache at admission (a multiple of block_size)
        self.num_committed_blocks = 0  # leading blocks block_manager.commit has registered (or found registered)
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.detokenizer = detokenizer
        self.logprobs: list[Any] = []  # engine.step.TokenLogprobs of each output token (params.logprobs set)
        # prompt token t's TokenLogprobs at [t] ([0] is None: nothing predicts it), when params.prompt_logprobs
        self.prompt_logprobs: list[Any] | None = [None] if params.prompt_logprobs is not None else None
        self.metrics = RequestMetrics(arrival_time=time.monotonic())
        self.num_pending = 0  # tokens sampled by launched steps, not read yet (async scheduling)
        # speculative decoding with a draft model: tokens whose K/V the draft model has (num_computed_tokens or one
        # fewer: after a step accepting every draft, the last draft is fed to it next step; engine/spec/)
        self.num_draft_computed = 0
        self._pad = [int(x) for x in initial_lookback.tolist()]  # [W] the lookback before position 0 (pad ids)

    # ----------------------------------------------------------------- views
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens read plus tokens sampled by steps in flight: what the scheduler plans with."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_scheduled_tokens - self.num_computed_tokens

    def lookback_before(self, position: int, pad: list[int] | None = None) -> list[int]:
        """The W compressed ids before ``position``, oldest first, pad-filled, DEAD kept; they must have been read.
        ``pad``: another hasher's lookback before position 0 (a draft model's W and pad id), else this engine's."""
        pad = self._pad if pad is None else pad
        w = len(pad)
        if position >= w:
            return self.compressed_ids[position - w:position]
        return pad[position:] + self.compressed_ids[:position]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    # ----------------------------------------------------------------- transitions
    def append_token(self, token_id: int, compressed_id: int) -> None:
        self.token_ids.append(int(token_id))
        self.compressed_ids.append(int(compressed_id))

    def reset_for_recompute(self) -> None:
        """Preempted: K/V and Engram state are dropped and rebuilt from ``token_ids`` when rescheduled."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.num_cached_tokens = 0
        self.num_committed_blocks = 0  # the keys stay: they are functions of the tokens
        self.num_draft_computed = 0
        self.status = SequenceStatus.WAITING
        self.metrics.num_preemptions += 1

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.metrics.finished_time = time.monotonic()
