"""The scheduler: which sequences run each step and how many tokens each, under the token
budget, ``max_num_seqs`` and the block pool, with preemption by recomputation or swapping.

The unit tests pin one behaviour each. The state machine adds requests, runs steps as
``LLMEngine.step`` would with a fake greedy model, aborts requests, and checks the
scheduler's promises at every step with pools small enough that preemption is common.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from test_block_manager import PICK, PROMPTS, KVShadow, check_block_manager

from rvllm.config import SchedulerConfig
from rvllm.engine.block_manager import BlockManager
from rvllm.engine.scheduler import Scheduler, SchedulerOutput
from rvllm.engine.sequence import Sequence, SequenceStatus
from rvllm.sampling_params import SamplingParams

BS = 4  # block size of the unit tests


def make_scheduler(num_blocks: int = 16, budget: int = 64, max_num_seqs: int = 8,
                   chunked: bool = True, mode: str = "recompute", num_cpu_blocks: int = 0,
                   caching: bool = True, policy: str = "fcfs") -> Scheduler:
    bm = BlockManager(num_blocks, BS, caching, num_cpu_blocks=num_cpu_blocks)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, chunked, policy=policy), bm, mode)


def add(sched: Scheduler, seq_id: int, prompt: int | list[int], max_tokens: int = 8,
        priority: int = 0) -> Sequence:
    """A request of one sample; a prompt given as a length is tokens no other shares."""
    if isinstance(prompt, int):
        prompt = list(range(100 * seq_id, 100 * seq_id + prompt))
    seq = Sequence(seq_id, str(seq_id), 0, prompt, SamplingParams(priority=priority),
                   float(seq_id), max_tokens)
    sched.add(seq)
    return seq


def next_token(seq: Sequence) -> int:
    """A fake greedy model: the next token depends on the sequence alone, so equal
    prompts continue equally (and recomputed ones hit the prefix cache)."""
    return 1 + sum(seq.token_ids[-2:]) % 3


def run(sched: Scheduler, out: SchedulerOutput) -> None:
    """What ``LLMEngine.step`` does with a step's batch once the model has run it."""
    for s in out.scheduled:
        samples = s.samples
        s.seq.num_computed_tokens += s.num_new_tokens
        sched.block_manager.cache_full_blocks(s.seq)
        if samples:
            s.seq.token_ids.append(next_token(s.seq))
            if s.seq.num_output_tokens >= s.seq.max_tokens:
                sched.finish(s.seq, SequenceStatus.FINISHED_LENGTH)


def step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    run(sched, out)
    return out


def batch(out: SchedulerOutput) -> list[tuple[int, int]]:
    return [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled]


# ---------------------------------------------------------------------- admission


def test_a_request_is_admitted_with_its_whole_prompt() -> None:
    sched = make_scheduler()
    seq = add(sched, 0, 10)
    out = sched.schedule()
    assert batch(out) == [(0, 10)]
    assert out.scheduled[0].samples
    assert sched.running == [seq] and seq.status is SequenceStatus.RUNNING
    assert len(seq.block_table) == 3


def test_requests_are_admitted_in_arrival_order() -> None:
    sched = make_scheduler()
    for i in range(3):
        add(sched, i, 2)
    assert batch(sched.schedule()) == [(0, 2), (1, 2), (2, 2)]


def test_admission_stops_at_max_num_seqs() -> None:
    sched = make_scheduler(max_num_seqs=2)
    seqs = [add(sched, i, 2) for i in range(3)]
    assert batch(step(sched)) == [(0, 2), (1, 2)]
    assert list(sched.waiting) == [seqs[2]]
    assert batch(sched.schedule()) == [(0, 1), (1, 1)]


def test_admission_stops_when_the_pool_is_short() -> None:
    sched = make_scheduler(num_blocks=3)
    add(sched, 0, 8)
    late = add(sched, 1, 8)
    assert batch(sched.schedule()) == [(0, 8)]
    assert list(sched.waiting) == [late]


def test_a_later_request_does_not_overtake_one_that_does_not_fit() -> None:
    sched = make_scheduler(num_blocks=3)
    add(sched, 0, 4)
    add(sched, 1, 12)  # three blocks: more than are left
    add(sched, 2, 1)  # one block would fit
    assert batch(sched.schedule()) == [(0, 4)]
    assert [s.seq_id for s in sched.waiting] == [1, 2]


def test_a_prompt_over_the_budget_is_chunked() -> None:
    sched = make_scheduler(budget=6)
    add(sched, 0, 10)
    first = step(sched)
    assert batch(first) == [(0, 6)] and not first.scheduled[0].samples
    second = sched.schedule()
    assert batch(second) == [(0, 4)] and second.scheduled[0].samples


def test_without_chunked_prefill_a_prompt_over_the_budget_left_waits() -> None:
    sched = make_scheduler(budget=8, chunked=False)
    add(sched, 0, 4)
    step(sched)
    add(sched, 1, 8)  # the decode takes one token of the eight
    add(sched, 2, 2)
    assert batch(sched.schedule()) == [(0, 1)]
    assert [s.seq_id for s in sched.waiting] == [1, 2]


# ----------------------------------------------------------------- the step's batch


def test_running_decodes_come_before_new_prefills() -> None:
    sched = make_scheduler()
    add(sched, 0, 3)
    step(sched)
    add(sched, 1, 5)
    assert batch(sched.schedule()) == [(0, 1), (1, 5)]


def test_the_budget_goes_to_running_sequences_oldest_first() -> None:
    sched = make_scheduler(budget=3)
    for i in range(3):
        add(sched, i, 1)
    step(sched)
    add(sched, 3, 1)
    sched.config.max_num_batched_tokens = 2  # now short of the three decodes
    assert batch(sched.schedule()) == [(0, 1), (1, 1)]


def test_a_chunked_prefill_continues_before_new_requests_are_admitted() -> None:
    sched = make_scheduler(budget=6)
    add(sched, 0, 10)
    step(sched)
    add(sched, 1, 3)
    assert batch(sched.schedule()) == [(0, 4), (1, 2)]


def test_a_prefix_hit_skips_the_cached_tokens() -> None:
    sched = make_scheduler()
    add(sched, 0, list(range(9)))
    step(sched)
    twin = add(sched, 1, list(range(9)))
    out = sched.schedule()
    assert batch(out)[-1] == (1, 1)
    assert twin.num_computed_tokens == 8 and twin.num_cached_tokens == 8
    assert (sched.block_manager.prefix_cache_queries,
            sched.block_manager.prefix_cache_hits) == (18, 8)


def test_a_step_samples_only_when_it_reaches_the_last_token() -> None:
    sched = make_scheduler(budget=4)
    add(sched, 0, 6)
    for want in (False, True, True):  # the first chunk, the second, a decode
        out = sched.schedule()
        assert [s.samples for s in out.scheduled] == [want]
        run(sched, out)


# --------------------------------------------------------------------- preemption


def _three_full_decodes(mode: str = "recompute", num_cpu_blocks: int = 0
                        ) -> tuple[Scheduler, list[Sequence]]:
    """Three prefilled sequences filling a three-block pool; the next step needs a
    fourth block for the first one's fifth token."""
    sched = make_scheduler(num_blocks=3, mode=mode, num_cpu_blocks=num_cpu_blocks)
    seqs = [add(sched, 0, 4), add(sched, 1, 3), add(sched, 2, 3)]
    step(sched)
    return sched, seqs


def test_preemption_takes_the_newest_running_sequence() -> None:
    sched, (a, b, c) = _three_full_decodes()
    out = sched.schedule()
    assert out.preempted == [c]
    assert batch(out) == [(0, 1), (1, 1)]
    assert sched.running == [a, b]


def test_a_recomputed_sequence_starts_over_at_the_front_of_the_queue() -> None:
    sched, (a, b, c) = _three_full_decodes()
    late = add(sched, 3, 1)
    sched.schedule()
    assert list(sched.waiting) == [c, late]
    assert c.status is SequenceStatus.WAITING and c.num_preemptions == 1
    assert c.num_computed_tokens == 0 and c.block_table == [] and c.num_tokens == 4


def test_the_newest_sequence_preempts_itself_when_nothing_newer_is_left() -> None:
    sched = make_scheduler(num_blocks=3)
    a, b = add(sched, 0, 4), add(sched, 1, 4)
    step(sched)  # a and b hold a block each; each now needs a second, and one is free
    out = sched.schedule()
    assert out.preempted == [b]
    assert batch(out) == [(0, 1)]
    assert sched.running == [a] and list(sched.waiting) == [b]


def test_the_priority_policy_admits_by_priority_then_arrival() -> None:
    sched = make_scheduler(policy="priority")
    for seq_id, priority in enumerate([2, 0, 1, 0]):
        add(sched, seq_id, 3, priority=priority)
    assert [s.seq_id for s in sched.waiting] == [1, 3, 2, 0]
    sched.schedule()
    assert [s.seq_id for s in sched.running] == [1, 3, 2, 0]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_priority_policy_preempts_the_last_in_priority(mode: str) -> None:
    """As in the three full decodes above, but the oldest is the least urgent: it goes,
    and comes back in its place by priority."""
    sched = make_scheduler(num_blocks=3, policy="priority", mode=mode, num_cpu_blocks=4)
    a = add(sched, 0, 4, priority=9)
    add(sched, 1, 3)
    add(sched, 2, 3)
    step(sched)
    late = add(sched, 3, 1, priority=5)
    out = sched.schedule()
    assert out.preempted == [a]
    assert batch(out) == [(1, 1), (2, 1)]
    queue = sched.swapped if mode == "swap" else sched.waiting
    assert list(queue) == ([a] if mode == "swap" else [late, a])


def test_swap_preemption_moves_the_newest_to_cpu_blocks() -> None:
    sched, (a, b, c) = _three_full_decodes("swap", num_cpu_blocks=4)
    table = list(c.block_table)
    out = sched.schedule()
    assert out.preempted == [c] and list(sched.swapped) == [c]
    assert [d for d, _ in out.blocks_to_swap_out] == table
    assert c.status is SequenceStatus.SWAPPED and c.num_computed_tokens == 3
    assert c.block_table == [] and len(c.cpu_block_table) == 1
    assert out.blocks_to_swap_in == []  # not back in the step that swapped it out


def test_swapped_sequences_resume_before_waiting_ones() -> None:
    sched, (a, b, c) = _three_full_decodes("swap", num_cpu_blocks=4)
    sched.schedule()
    sched.finish(a, SequenceStatus.FINISHED_ABORTED)
    late = add(sched, 3, 1)
    out = sched.schedule()
    assert len(out.blocks_to_swap_in) == 1
    assert batch(out) == [(1, 1), (2, 1), (3, 1)]
    assert sched.running == [b, c, late] and c.status is SequenceStatus.RUNNING


def test_no_request_is_admitted_while_a_sequence_is_swapped_out() -> None:
    sched, (a, b, c) = _three_full_decodes("swap", num_cpu_blocks=4)
    sched.schedule()
    add(sched, 3, 1)
    out = sched.schedule()  # no room to resume c: the new request waits behind it
    assert batch(out) == [(0, 1), (1, 1)]
    assert list(sched.swapped) == [c] and [s.seq_id for s in sched.waiting] == [3]


def test_swap_preemption_without_cpu_room_recomputes() -> None:
    sched, (a, b, c) = _three_full_decodes("swap", num_cpu_blocks=0)
    out = sched.schedule()
    assert out.preempted == [c] and out.blocks_to_swap_out == []
    assert list(sched.waiting) == [c] and not sched.swapped


# ---------------------------------------------------------------------- finishing


@pytest.mark.parametrize("where", ["waiting", "running", "swapped"])
def test_finish_takes_a_sequence_out_and_frees_its_blocks(where: str) -> None:
    sched, (a, b, c) = _three_full_decodes("swap", num_cpu_blocks=4)
    sched.schedule()  # c swapped out
    seq = {"waiting": add(sched, 3, 1), "running": b, "swapped": c}[where]
    sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
    assert seq.status is SequenceStatus.FINISHED_ABORTED
    assert seq not in sched.waiting and seq not in sched.running and seq not in sched.swapped
    assert seq.block_table == [] and seq.cpu_block_table == []
    assert len(sched.block_manager.cpu_free) == (4 if where == "swapped" else 3)


def test_has_unfinished_until_every_sequence_is_finished() -> None:
    sched = make_scheduler()
    assert not sched.has_unfinished()
    seq = add(sched, 0, 2, max_tokens=2)
    while sched.has_unfinished():
        step(sched)
    assert seq.status is SequenceStatus.FINISHED_LENGTH and seq.num_output_tokens == 2
    assert sched.block_manager.num_free_blocks == 16


# ---------------------------------------------------------------- the state model


class SchedulerMachine(RuleBasedStateMachine):
    """Requests arrive (some with two samples sharing a prompt), steps run as the engine
    runs them with a fake greedy model that sometimes stops, and requests are aborted.
    Each step's batch is checked against what the scheduler promises, and every state
    against the block manager's invariants and the books of which sequence is where."""

    def __init__(self, mode: str, chunked: bool, policy: str = "fcfs") -> None:
        super().__init__()
        self.mode, self.chunked, self.policy = mode, chunked, policy
        self.requests: list[list[Sequence]] = []
        self.everyone: list[Sequence] = []

    @initialize(block_size=st.sampled_from([1, 2, 4]), max_model_len=st.integers(4, 24),
                spare_blocks=st.integers(0, 4), max_num_seqs=st.integers(1, 4),
                budget=st.integers(1, 32), caching=st.booleans(),
                num_cpu_blocks=st.integers(1, 12), steps=st.sampled_from([1, 3]))
    def setup(self, block_size: int, max_model_len: int, spare_blocks: int,
              max_num_seqs: int, budget: int, caching: bool, num_cpu_blocks: int,
              steps: int) -> None:
        # As LLMEngine checks at start-up: the pool holds a whole sequence, and without
        # chunking the budget holds a whole prompt.
        num_blocks = -(-max_model_len // block_size) + spare_blocks
        if not self.chunked:
            budget = max(budget, max_model_len)
        self.max_model_len = max_model_len
        self.bm = BlockManager(num_blocks, block_size, caching,
                               num_cpu_blocks=num_cpu_blocks if self.mode == "swap" else 0)
        self.config = SchedulerConfig(max_num_seqs, budget, self.chunked, steps, self.policy)
        self.sched = Scheduler(self.config, self.bm, self.mode)
        self.shadow = KVShadow(self.bm)

    # ------------------------------------------------------------------ requests

    @rule(prompt=PROMPTS, max_tokens=st.integers(1, 24), n=st.sampled_from([1, 1, 2]),
          prompt_logprobs=st.booleans(), priority=st.integers(0, 2))
    def add_request(self, prompt: list[int], max_tokens: int, n: int,
                    prompt_logprobs: bool, priority: int) -> None:
        """As ``LLMEngine.add_request``: a sequence per sample, each one's prompt and
        completion within ``max_model_len``. Prompt logprobs bypass the prefix cache.
        Priorities only under the priority policy."""
        prompt = prompt[:self.max_model_len - 1]
        max_tokens = min(max_tokens, self.max_model_len - len(prompt))
        params = SamplingParams(n=n, prompt_logprobs=1 if prompt_logprobs else None,
                                priority=priority if self.policy == "priority" else 0)
        request_id = str(len(self.requests))
        seqs = []
        for index in range(n):
            seq_id = len(self.everyone)
            seq = Sequence(seq_id, request_id, index, prompt, params, float(seq_id), max_tokens)
            self.everyone.append(seq)
            seqs.append(seq)
            self.sched.add(seq)
        self.requests.append(seqs)

    @precondition(lambda self: any(not s.status.is_finished for s in self.everyone))
    @rule(i=PICK)
    def abort_request(self, i: int) -> None:
        live = [r for r in self.requests if any(not s.status.is_finished for s in r)]
        self._abort(live[i % len(live)])

    @precondition(lambda self: self.sched.swapped
                  or any(s.num_preemptions for s in self.sched.waiting))
    @rule(i=PICK)
    def abort_preempted_request(self, i: int) -> None:
        """Preempted sequences are short-lived: aim some aborts at them."""
        preempted = list(self.sched.swapped) + [s for s in self.sched.waiting
                                                if s.num_preemptions]
        seq = preempted[i % len(preempted)]
        self._abort(next(r for r in self.requests if any(s is seq for s in r)))

    def _abort(self, request: list[Sequence]) -> None:
        self.shadow.before(self.everyone)
        aborted = [s for s in request if not s.status.is_finished]
        for seq in aborted:
            self.sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
        self.shadow.after(self.everyone, released=aborted)

    # --------------------------------------------------------------------- steps

    @rule(stop_at=st.one_of(st.none(), st.integers(0, 7)))
    def step(self, stop_at: int | None) -> None:
        """One engine step; the ``stop_at``-th token sampled in it is a stop token."""
        self._step(stop_at)

    def _step(self, stop_at: int | None) -> None:
        sched = self.sched
        before = _Before(sched)
        self.shadow.before(self.everyone)
        out = sched.schedule()
        self.shadow.after(self.everyone, released=out.preempted,
                          swap_out=out.blocks_to_swap_out, swap_in=out.blocks_to_swap_in)
        self._check_batch(out, before)
        self.consistent()
        self._execute(out, stop_at)

    def _execute(self, out: SchedulerOutput, stop_at: int | None) -> None:
        """What ``LLMEngine.step`` does once ``ModelRunner.execute`` has run the batch:
        count the computed tokens, cache the full blocks, append each sample, stop."""
        self.shadow.before(self.everyone)
        finished: list[Sequence] = []
        sampled = 0
        for s in out.scheduled:
            seq = s.seq
            samples = s.samples
            for k in range(out.num_steps if samples else 1):
                if seq.status.is_finished:
                    break  # the tokens of a run ahead past a stop are dropped
                n = s.num_new_tokens if k == 0 else 1
                self.shadow.write(seq, seq.num_computed_tokens, seq.num_computed_tokens + n)
                seq.num_computed_tokens += n
                self.bm.cache_full_blocks(seq)
                if samples:
                    seq.token_ids.append(next_token(seq))
                    status = self._stop(seq, sampled == stop_at)
                    sampled += 1
                    if status is not None:
                        self.sched.finish(seq, status)
                        finished.append(seq)
        self.shadow.after(self.everyone, released=finished)

    def _stop(self, seq: Sequence, stop_token: bool) -> SequenceStatus | None:
        if stop_token:
            return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    # ------------------------------------------------------------------- checks

    def _check_batch(self, out: SchedulerOutput, before: _Before) -> None:
        cfg, sched, bm = self.config, self.sched, self.bm
        seqs = [s.seq for s in out.scheduled]
        assert not (before.unfinished and out.is_empty), "work is left but nothing ran"

        # The limits.
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len(sched.running) <= cfg.max_num_seqs
        assert all(s.num_new_tokens >= 1 for s in out.scheduled)
        assert len(set(map(id, seqs))) == len(seqs), "a sequence is scheduled twice"
        assert all(any(seq is r for r in sched.running) for seq in seqs)
        for s in out.scheduled:
            ahead = max(s.num_new_tokens, out.num_steps)
            assert len(s.seq.block_table) >= bm.blocks_needed(s.seq.num_computed_tokens + ahead)
        if out.num_steps > 1:
            assert all(s.num_new_tokens == 1 and s.samples for s in out.scheduled)
            assert not sched.waiting and not sched.swapped and not out.preempted

        # Preemption takes the newest running sequences, newest first.
        k = len(out.preempted)
        assert out.preempted == before.running[::-1][:k]
        assert not any(seq is p for seq in seqs for p in out.preempted)
        for seq in out.preempted:
            assert seq.status in (SequenceStatus.WAITING, SequenceStatus.SWAPPED)

        # The batch: running sequences oldest first while the budget lasts, then
        # swapped-out ones resumed oldest first, then waiting ones first come first
        # served; nothing new joins a step that preempted or while any is swapped out.
        survivors = before.running[:len(before.running) - k]
        n_run = 0
        while n_run < len(seqs) and n_run < len(survivors) and seqs[n_run] is survivors[n_run]:
            n_run += 1
        rest = seqs[n_run:]
        resumed = [seq for seq in rest if seq.seq_id in before.swapped_ids]
        admitted = [seq for seq in rest if seq.seq_id in before.waiting_ids]
        assert rest == resumed + admitted, "a running sequence was skipped or reordered"
        assert resumed == before.swapped[:len(resumed)]
        assert admitted == before.waiting[:len(admitted)]
        if rest:
            assert n_run == len(survivors) and not k
        if admitted:
            assert resumed == before.swapped and not sched.swapped

        # Decodes first: no prefill chunk runs ahead of, or instead of, a running decode.
        decodes = [seq for seq in survivors if before.left[seq.seq_id] == 1]
        first_prefill = next((i for i, s in enumerate(out.scheduled) if s.num_new_tokens > 1),
                             len(seqs))
        for seq in decodes:
            if first_prefill < len(seqs):
                assert any(seq is x for x in seqs[:first_prefill]), (
                    f"a prefill ran before (or instead of) the decode of {seq.seq_id}")

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "sched"):
            return
        sched, bm = self.sched, self.bm
        waiting, running, swapped = list(sched.waiting), sched.running, list(sched.swapped)

        # No sequence is lost or duplicated: each is in exactly one place.
        where: dict[int, str] = {}
        for name, group in (("waiting", waiting), ("running", running), ("swapped", swapped)):
            for seq in group:
                assert seq.seq_id not in where, f"{seq.seq_id} is {where[seq.seq_id]} and {name}"
                where[seq.seq_id] = name
        status = {"waiting": SequenceStatus.WAITING, "running": SequenceStatus.RUNNING,
                  "swapped": SequenceStatus.SWAPPED}
        for seq in self.everyone:
            if seq.status.is_finished:
                assert seq.seq_id not in where, f"finished {seq.seq_id} is still {where}"
                assert not seq.block_table and not seq.cpu_block_table
            else:
                assert seq.seq_id in where, f"{seq.seq_id} is lost"
                assert seq.status is status[where[seq.seq_id]]
        assert len(where) == sum(not s.status.is_finished for s in self.everyone)

        for seq in waiting:
            assert not seq.block_table and not seq.cpu_block_table
            assert seq.num_computed_tokens == 0
        for seq in swapped:
            assert not seq.block_table
            assert len(seq.cpu_block_table) >= bm.blocks_needed(seq.num_computed_tokens)
        for seq in running:
            assert not seq.cpu_block_table
            assert len(seq.block_table) >= bm.blocks_needed(seq.num_computed_tokens)
            assert seq.num_computed_tokens <= seq.num_tokens
        assert len(running) <= self.config.max_num_seqs

        if self.policy == "priority":
            # Every queue in priority order, then arrival (running too: preemption takes
            # its last).
            for group in (waiting, running, swapped):
                assert [_rank(s) for s in group] == sorted(_rank(s) for s in group)
        else:
            # First come first served: requests that never ran wait in arrival order,
            # behind the preempted ones that went back to the front.
            fresh = [seq.seq_id for seq in waiting if not seq.num_preemptions]
            assert fresh == sorted(fresh)
            assert [seq.num_preemptions > 0 for seq in waiting] == \
                sorted((seq.num_preemptions > 0 for seq in waiting), reverse=True)

        check_block_manager(bm, self.shadow, self.everyone)

    def teardown(self) -> None:
        """Every request finishes if steps keep coming, and then every block is free."""
        if not hasattr(self, "sched"):
            return
        # The oldest running sequence is never preempted, so it gains a token every step
        # until it finishes; each sequence has at most two sequences' worth to compute.
        unfinished = sum(not s.status.is_finished for s in self.everyone)
        for _ in range(2 * 2 * self.max_model_len * unfinished):
            if not self.sched.has_unfinished():
                break
            self._step(None)
        assert not self.sched.has_unfinished()
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert len(self.bm.cpu_free) == self.bm.num_cpu_blocks


class _Before:
    """The scheduler's queues as a step found them."""

    def __init__(self, sched: Scheduler) -> None:
        self.unfinished = sched.has_unfinished()
        self.running = list(sched.running)
        self.waiting = list(sched.waiting)
        self.swapped = list(sched.swapped)
        self.waiting_ids = {s.seq_id for s in self.waiting}
        self.swapped_ids = {s.seq_id for s in self.swapped}
        self.left = {s.seq_id: s.num_tokens - s.num_computed_tokens for s in self.running}


def _rank(seq: Sequence) -> tuple[int, float, int]:
    return seq.params.priority, seq.arrival_time, seq.seq_id


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole-prompts"])
@pytest.mark.parametrize("mode,policy", [("recompute", "fcfs"), ("swap", "fcfs"),
                                         ("recompute", "priority"), ("swap", "priority")])
def test_random_traffic_keeps_the_schedulers_promises(mode: str, policy: str,
                                                      chunked: bool) -> None:
    run_state_machine_as_test(lambda: SchedulerMachine(mode, chunked, policy), settings=settings(
        max_examples=60, stateful_step_count=40, deadline=None, derandomize=True,
        database=None, suppress_health_check=[HealthCheck.too_slow]))
