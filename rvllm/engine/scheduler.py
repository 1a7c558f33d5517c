"""Continuous batching: which sequences run this step, and how many tokens each.

Every step has a token budget (``max_num_batched_tokens``). Running sequences
go first, oldest first, each taking what it still has to compute (one token
for a decode, a chunk for an unfinished prefill). Waiting sequences are then
admitted in arrival order while the budget, ``max_num_seqs`` and the block
pool allow; a prompt larger than the remaining budget is chunked. When the pool
runs dry, the newest running sequence is preempted: its blocks are freed and
it goes back to the front of the queue, to be recomputed later.

With ``num_scheduler_steps`` above one, a step of decodes alone, with nothing waiting,
may run several decode steps ahead (``SchedulerOutput.num_steps``): each sequence gets
the blocks of every one of those steps' positions up front, and never by preempting
another for them.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from rvllm.config import SchedulerConfig
from rvllm.engine.block_manager import BlockManager
from rvllm.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """This step computes the last known token, so its logits give the next one."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    # Decode steps the batch may run before the next schedule (each sequence has the
    # blocks for them): one, unless ``Scheduler._lookahead`` found more.
    num_steps: int = 1

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 preemption_mode: str = "recompute") -> None:
        self.config = config
        self.block_manager = block_manager
        self.preemption_mode = preemption_mode
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.num_swap_outs = 0
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self._queue(self.waiting, seq)

    def _queue(self, queue: deque[Sequence] | list[Sequence], seq: Sequence) -> None:
        """Into ``queue`` at the end; under the priority policy, in its place by priority,
        then arrival."""
        if self.config.policy == "priority":
            bisect.insort(queue, seq, key=_priority)
        else:
            queue.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.ends_in_flight:  # its last token is being sampled (async scheduling)
                i += 1
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self._fit_running(seq, n, out):
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
        if not out.preempted:
            budget = self._swap_in(budget, out)
            if not self.swapped:
                self._admit_waiting(budget, out)
        out.num_steps = self._lookahead(out)
        return out

    def _lookahead(self, out: SchedulerOutput) -> int:
        """How many decode steps ``out`` may run: up to ``num_scheduler_steps`` when it
        is all decodes, nothing waits, and the pool has the blocks for every sequence's
        next positions; never more than any of its sequences has tokens left to make."""
        steps = self.config.num_scheduler_steps
        if steps == 1 or self.waiting or self.swapped or out.preempted or not out.scheduled:
            return 1
        for s in out.scheduled:
            if s.num_new_tokens != 1 or not s.samples:
                return 1
            steps = min(steps, s.seq.max_tokens - s.seq.num_output_tokens)
        if steps <= 1:
            return 1
        # A failure leaves the blocks taken so far in place: the coming steps use them.
        if not all(self.block_manager.allocate_slots(s.seq, steps) for s in out.scheduled):
            return 1
        return steps

    def _fit_running(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Find blocks for ``seq``, preempting newer sequences; False if it was preempted."""
        while not self.block_manager.allocate_slots(seq, n):
            # The newest; under the priority policy, running is in priority order, so the
            # last in priority (then arrival), and never one already scheduled this step.
            victim = self.running.pop()
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.num_preemptions += 1
        out.preempted.append(seq)
        bm = self.block_manager
        if self.preemption_mode == "swap" and bm.can_swap_out(seq):
            out.blocks_to_swap_out.extend(bm.swap_out(seq))
            self.num_swap_outs += 1
            seq.status = SequenceStatus.SWAPPED
            self._queue(self.swapped, seq)
            return
        bm.free(seq)
        seq.reset_for_recompute()
        if self.config.policy == "priority":
            bisect.insort(self.waiting, seq, key=_priority)
        else:
            self.waiting.appendleft(seq)

    def _swap_in(self, budget: int, out: SchedulerOutput) -> int:
        """Resume swapped sequences, oldest first; they go before any new request."""
        bm = self.block_manager
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not bm.can_swap_in(seq, n):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(bm.swap_in(seq))
            if not bm.allocate_slots(seq, n):  # cannot fail: can_swap_in counted these
                raise RuntimeError("swap-in could not place the resumed tokens")
            seq.status = SequenceStatus.RUNNING
            self._queue(self.running, seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return budget

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.lora_id and not self._lora_fits(seq.lora_id):
                break
            cached = bm.find_cached_prefix(seq)
            num_cached = len(cached) * bm.block_size
            n = seq.num_tokens - num_cached
            if n > budget and not self.config.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not bm.allocate_slots(seq, n, cached):
                break
            bm.count_lookup(seq.num_tokens, num_cached)
            seq.num_computed_tokens = num_cached
            seq.num_cached_tokens = max(seq.num_cached_tokens, num_cached)
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self._queue(self.running, seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n

    def _lora_fits(self, lora_id: int) -> bool:
        """Whether a sequence of adapter ``lora_id`` may join the running ones: its
        adapter runs already, or fewer than ``max_loras`` do."""
        active = {s.lora_id for s in self.running if s.lora_id}
        return lora_id in active or len(active) < self.config.max_loras

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Take a sequence out of the schedule for good and release its blocks."""
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.block_manager.free(seq)
        self.block_manager.free_cpu(seq)


def _priority(seq: Sequence) -> tuple[int, float, int]:
    """A sequence's place under ``--scheduling-policy priority``: its request's priority
    (lower first), then arrival."""
    return seq.params.priority, seq.arrival_time, seq.seq_id
