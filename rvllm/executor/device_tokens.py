"""Sampled tokens that stay on the device between overlapped steps (``--async-scheduling``).

A step that replays a decode graph with every row plain greedy leaves its tokens where
the greedy kernel wrote them: the next step's inputs take them from there
(``DecodeGraphs.run``'s ``feed``), so it can be launched before the host has seen them.
Their copy to the host goes behind the step, into pinned memory, and the engine's
thread waits for that copy alone (``resolve_outputs``) when it takes the step's outputs:
not for the step after it, which may already be queued on the same stream.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from rvllm.engine.scheduler import ScheduledSeq

# The token id of a token that a step in flight is sampling (no vocabulary has it).
PLACEHOLDER = -1


class DeviceTokens:
    """One step's sampled tokens and their logprobs: ``token_ids`` on the device (what the
    next step reads), their host copy once ``resolve`` has waited for it, and the row of
    each sequence (by id)."""

    def __init__(self, token_ids: torch.Tensor, logprobs: torch.Tensor,
                 seq_ids: Iterable[int]) -> None:
        self.token_ids = token_ids
        self.rows = {seq_id: row for row, seq_id in enumerate(seq_ids)}
        self._event: torch.cuda.Event | None = None
        if token_ids.device.type == "cuda":
            # Pinned, so the copy is queued behind the step rather than waited for here.
            self._host_ids = torch.empty(token_ids.shape, dtype=token_ids.dtype,
                                         pin_memory=True)
            self._host_logprobs = torch.empty(logprobs.shape, dtype=logprobs.dtype,
                                              pin_memory=True)
            self._host_ids.copy_(token_ids, non_blocking=True)
            self._host_logprobs.copy_(logprobs, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host_ids, self._host_logprobs = token_ids, logprobs
        self._resolved: tuple[list[int], list[float]] | None = None

    def resolve(self) -> tuple[list[int], list[float]]:
        """The tokens and logprobs as lists, by row: waits for their copy alone."""
        if self._resolved is None:
            if self._event is not None:
                self._event.synchronize()
            self._resolved = (self._host_ids.tolist(), self._host_logprobs.tolist())
        return self._resolved

    def sources(self, scheduled: Iterable[ScheduledSeq]) -> list[int]:
        """For each decode in ``scheduled``: the row of this step's tokens its input is,
        where that input is still a placeholder, else -1."""
        out = []
        for s in scheduled:
            seq = s.seq
            fed = seq.token_ids[seq.num_computed_tokens] == PLACEHOLDER
            out.append(self.rows[seq.seq_id] if fed else -1)
        return out


def fill_placeholders(scheduled: Iterable[ScheduledSeq], tokens: dict[int, int]) -> None:
    """Put each sequence's token of the step before (``tokens``, by sequence id) in place
    of the placeholder its token ids end with."""
    for s in scheduled:
        ids = s.seq.token_ids
        if ids and ids[-1] == PLACEHOLDER:
            ids[-1] = tokens[s.seq.seq_id]


def host_tokens(feed: DeviceTokens) -> dict[int, int]:
    """``feed``'s tokens by sequence id, on the host (waits for them)."""
    ids, _ = feed.resolve()
    return {seq_id: ids[row] for seq_id, row in feed.rows.items()}


def resolve_outputs(outputs: Iterable[Any]) -> None:
    """Fill in the tokens and logprobs of a step's outputs (``SeqStepOutput``) whose
    tokens stayed on the device."""
    for out in outputs:
        if out.pending is not None:
            ids, logprobs = out.pending.resolve()
            out.token_id, out.logprob = ids[out.pending_row], logprobs[out.pending_row]
            out.pending = None
