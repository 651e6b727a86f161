"""One pipeline stage of the single-device decoder, applied around it (the model knows no stages): ``StageModel`` runs
the layers of its ``Stage`` (parallel/pp.py) of a model built with only those layers (``load_model(layers=...)``). The
first stage embeds the step's tokens; every other stage receives the streams from the stage before it; the last stage
returns the final-normed hidden rows, every other one hands its streams on and returns None. ``StageLink`` moves the
streams between stages with torch.distributed point-to-point messages (gloo on the CPU, NCCL on GPUs), rank t of stage
s to rank t of stage s + 1 (the streams are replicated over a stage's tensor-parallel ranks).

What crosses a cut, per step (T packed tokens, hc streams, hidden H)::

    header  int64 [2]               (delta kind: 0 none | 1 dense | 2 split-K partials, number of partials)
    h       model dtype [T, hc, H]  the residual streams after the stage's last layer
    delta   model dtype [T, H]      the last MLP output not yet added (hc = 1 only), or float32 [K, T, H] partials

Sends are asynchronous (``isend``): a stage goes on to its next microbatch while the next stage still computes the one
before, and each send's buffers are kept until it completed (waited for before the next send). Messages between two
ranks arrive in the order sent, so microbatches meet each stage in launch order."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from engram.model.decoder import EngramDecoder
from engram.model.layers.split_linear import Partials
from engram.parallel.pp import Stage

NO_DELTA, DENSE_DELTA, PARTIAL_DELTA = 0, 1, 2


class StageLink:
    """Point-to-point messages of one rank to the same tensor-parallel rank of the next stage and from that of the
    previous one (global ranks; None at the ends). ``group``: the process group carrying them (None: the world)."""

    def __init__(self, prev_rank: int | None, next_rank: int | None, device: torch.device, group=None):
        self.prev_rank, self.next_rank, self.device, self.group = prev_rank, next_rank, torch.device(device), group
        self._sending: list = []  # (work, buffers) of the sends not known to be complete

    def send(self, h: torch.Tensor, delta: torch.Tensor | Partials | None) -> None:
        """Hand ``h`` [T, hc, H] and ``delta`` on to the next stage (returns once queued; the previous send is waited
        for first, so at most one step's buffers are in flight)."""
        self.flush()
        if delta is None:
            header, tensors = [NO_DELTA, 0], [h]
        elif isinstance(delta, Partials):
            header, tensors = [PARTIAL_DELTA, delta.parts.shape[0]], [h, delta.parts]
        else:
            header, tensors = [DENSE_DELTA, 0], [h, delta]
        buffers = [torch.tensor(header, dtype=torch.long, device=self.device), *(t.contiguous() for t in tensors)]
        self._sending = [(dist.isend(b, self.next_rank, group=self.group), b) for b in buffers]

    def receive(self, num_tokens: int, hc: int, hidden: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor | Partials | None]:
        """The previous stage's ``(h, delta)`` of the next step: h [T, hc, H] in ``dtype``."""
        header = torch.empty(2, dtype=torch.long, device=self.device)
        dist.recv(header, self.prev_rank, group=self.group)
        kind, splits = header.tolist()
        h = torch.empty(num_tokens, hc, hidden, dtype=dtype, device=self.device)
        dist.recv(h, self.prev_rank, group=self.group)
        if kind == NO_DELTA:
            return h, None
        if kind == DENSE_DELTA:
            delta = torch.empty(num_tokens, hidden, dtype=dtype, device=self.device)
            dist.recv(delta, self.prev_rank, group=self.group)
            return h, delta
        parts = torch.empty(splits, num_tokens, hidden, dtype=torch.float32, device=self.device)
        dist.recv(parts, self.prev_rank, group=self.group)
        return h, Partials(parts, dtype)

    def flush(self) -> None:
        """Wait until every send made so far has completed."""
        for work, _ in self._sending:
            work.wait()
        self._sending = []


class StageModel(torch.nn.Module):
    """The decoder as stage ``stage`` of ``num_stages`` runs it: ``forward(step, kv) -> hidden [N, H]`` on the last
    stage, None on the others (their streams went on through ``link``). ``link`` None (before the stage is linked,
    e.g. during the Worker's memory profile): a stage after the first reads zero streams, and nothing is sent.
    ``intake``: called before the stage waits for the previous stage's streams and again after its layers, on every
    rank of the stage at the same points of the same step (the stage's inbox learns of the steps that arrived
    meanwhile and starts their lookups: engine/stage_inbox.py); None: nothing is called."""

    def __init__(self, decoder: EngramDecoder, stage: Stage, num_stages: int, link: StageLink | None = None,
                 intake: Callable[[], None] | None = None):
        super().__init__()
        if decoder.held_layers != stage.layers:
            raise ValueError(f"stage {stage.index} runs layers {stage.layers} but the model holds "
                             f"{decoder.held_layers}")
        self.decoder, self.stage, self.num_stages, self.link = decoder, stage, num_stages, link
        self.intake = intake
        self.relay = None  # this rank's end of the sampled-id relay (parallel/pp_relay.py), set once linked
        self.config = decoder.config
        self.model = decoder.model  # layers by global index (LayerGap where another stage holds one)

    @property
    def is_first(self) -> bool:
        return self.stage.index == 0

    @property
    def is_last(self) -> bool:
        return self.stage.index == self.num_stages - 1

    @property
    def engram_layers(self) -> dict:
        return self.decoder.engram_layers

    @property
    def held_layers(self) -> range:
        return self.decoder.held_layers

    def pack_projections(self) -> None:
        self.decoder.pack_projections()

    def forward(self, step, kv) -> torch.Tensor | None:
        h = delta = None
        if not self.is_first:
            t, cfg = int(step.token_ids.shape[0]), self.config
            dtype = _dtype_of(self.decoder)
            if self.link is None:
                h = torch.zeros(t, cfg.hc_mult, cfg.hidden_size, dtype=dtype, device=step.token_ids.device)
            else:
                if self.intake is not None:
                    self.intake()
                h, delta = self.link.receive(t, cfg.hc_mult, cfg.hidden_size, dtype)
        state = self.decoder.forward_begin(step, kv, h, delta)
        self.decoder.forward_layers(state, self.stage.start, self.stage.end)
        if self.intake is not None:
            self.intake()
        if self.is_last:
            return self.decoder.forward_end(state)
        if self.link is not None:
            self.link.send(state.h, state.delta)
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.decoder.compute_logits(hidden)


def _dtype_of(decoder: EngramDecoder) -> torch.dtype:
    """The dtype of the model's streams: its layers' norms'."""
    layer = decoder.model.layers[decoder.held_layers.start]
    return layer.input_layernorm.weight.dtype
