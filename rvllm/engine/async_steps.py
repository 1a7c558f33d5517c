"""Asynchronous scheduling (``--async-scheduling``): the host schedules step t+1 and
builds its inputs while the model runs step t, and detokenizes and checks stops of step
t behind step t+1.

The model's steps run in order on one thread of their own (``StepWorker``), the stand-in
for a device stream: on a GPU it launches the kernels and waits for the sampled tokens
there; on the CPU it runs the step's torch and numba code, which release the GIL. The
engine's thread meanwhile schedules the next step. A sequence in the step that is still
running has the token it is sampling as a placeholder (``PLACEHOLDER``) at the end of its
token ids: the scheduler gives it its next position, and the block manager its slot, as
if the token were known. The next step reads the real token where it needs it, on the
worker: the worker keeps each step's sampled tokens and puts them in place of the
placeholders of the step after it before running it (``StepWorker._run``), so no sampled
token waits for the engine's thread to reach the next step.

The step runs on a copy of each of its sequences (``step_view``), taken when it is
scheduled: the engine's thread goes on changing the sequences (their tokens, blocks and
counts) while the worker reads them. The steps run one after another, so a block that a
finished or preempted sequence gives back is only written by a later step, after the one
that wrote it last.

The engine takes a step's outputs one call later (``LLMEngine.step``): the placeholders
are taken out, the tokens appended as without overlap (stop strings, ``max_tokens``,
logprobs and detokenizing run there), and the placeholders of the step in flight put
back for the sequences still running. A sequence that a stop ends there was already in
the next step: that step's token for it is dropped. One that will surely end with the
token in flight (``max_tokens``, the model's length) is not scheduled again
(``Sequence.ends_in_flight``).
"""

from __future__ import annotations

import copy
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from rvllm.engine.scheduler import ScheduledSeq, SchedulerOutput
from rvllm.executor.device_tokens import PLACEHOLDER, DeviceTokens, fill_placeholders

if TYPE_CHECKING:
    from rvllm.engine.sequence import Sequence
    from rvllm.executor.model_runner import ModelRunner, SeqStepOutput

__all__ = ["PLACEHOLDER", "StepInFlight", "StepWorker", "step_view", "strip_placeholders"]


def step_view(seq: Sequence) -> Sequence:
    """A copy of ``seq`` for the worker to run a step on: its own token ids and block
    table; ``live`` names the sequence it was taken from."""
    view = copy.copy(seq)
    view.token_ids = list(seq.token_ids)
    view.block_table = list(seq.block_table)
    view.live = seq  # type: ignore[attr-defined]
    return view


@dataclass
class StepInFlight:
    """A step handed to the worker: its outputs to come, and the sequences that got a
    placeholder for the token it samples, with the placeholder's index."""

    future: Future
    sched: SchedulerOutput
    placeholders: list[tuple[Sequence, int]] = field(default_factory=list)


class StepWorker:
    """Runs the model's steps, one after another, on a thread of its own."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        gpu = torch.cuda.current_device() if runner.device.type == "cuda" else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rvllm-step",
                                        initializer=_thread_start, initargs=(gpu,))
        # The tokens the last step sampled, by sequence id, or still on the device: the
        # next step's placeholders.
        self._sampled: dict[int, int] | DeviceTokens = {}

    def submit(self, sched: SchedulerOutput) -> StepInFlight:
        """Hand the worker ``sched`` as copies of its sequences, then give each sequence
        that samples a placeholder for its token, and count the step's tokens computed:
        the next schedule sees the sequences as after this step."""
        views = SchedulerOutput(
            scheduled=[ScheduledSeq(step_view(s.seq), s.num_new_tokens) for s in sched.scheduled],
            blocks_to_swap_out=list(sched.blocks_to_swap_out),
            blocks_to_swap_in=list(sched.blocks_to_swap_in),
        )
        placeholders = []
        for s in sched.scheduled:
            seq = s.seq
            samples = s.samples
            seq.num_computed_tokens += s.num_new_tokens
            if samples:
                placeholders.append((seq, len(seq.token_ids)))
                seq.token_ids.append(PLACEHOLDER)
        return StepInFlight(self._pool.submit(self._run, views), sched, placeholders)

    def _run(self, sched: SchedulerOutput) -> list[SeqStepOutput]:
        sampled, self._sampled = self._sampled, {}
        if isinstance(sampled, DeviceTokens):
            # The runner reads them on the device where it can, else waits for them.
            outputs = self.runner.execute(sched, feed=sampled, defer=True)
        else:
            fill_placeholders(sched.scheduled, sampled)
            outputs = self.runner.execute(sched, defer=True)
        pending = outputs[0].pending if outputs else None
        if pending is not None:  # every row's token is still on the device
            self._sampled = pending
        else:
            self._sampled = {o.seq.seq_id: o.token_id for o in outputs
                             if o.token_id is not None}
        return outputs

    def forget(self) -> None:
        """After a step failed: the steps after it have no tokens to take."""
        self._sampled = {}

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def _thread_start(gpu: int | None) -> None:
    """What a new thread does not inherit: autograd off (the steps make no graphs), and
    on a GPU the engine thread's current device (a data-parallel replica's need not be
    the first)."""
    torch.set_grad_enabled(False)
    if gpu is not None:
        torch.cuda.set_device(gpu)


def strip_placeholders(seq: Sequence) -> int:
    """Take the placeholders off the end of ``seq``'s token ids; how many there were."""
    ids = seq.token_ids
    n = 0
    while ids and ids[-1] == PLACEHOLDER:
        ids.pop()
        n += 1
    return n
