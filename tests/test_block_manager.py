"""The block manager: reference-counted KV blocks, the prefix cache by chained block hashes,
the order in which free blocks are reused, and swapping to CPU blocks.

The unit tests pin one behaviour each. The state machine drives random allocations,
growth, shared prefixes, frees and both kinds of preemption, and after every step checks
the manager against ``KVShadow``, a model of what the engine would have written into each
block. ``test_scheduler.py`` reuses ``KVShadow`` and ``check_block_manager``.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq

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

from rvllm.engine.block_manager import BlockManager
from rvllm.engine.sequence import Sequence
from rvllm.sampling_params import SamplingParams

BS = 4  # block size of the unit tests


def make_seq(tokens: Iterable[int], seq_id: int = 0, max_tokens: int = 64,
             params: SamplingParams | None = None) -> Sequence:
    return Sequence(seq_id, str(seq_id), 0, list(tokens), params or SamplingParams(), 0.0,
                    max_tokens)


def admit(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> bool:
    """What the scheduler does to start a waiting sequence: take its cached prefix and
    blocks for ``num_tokens`` more (all the rest by default), then compute them."""
    cached = bm.find_cached_prefix(seq)
    num_cached = len(cached) * bm.block_size
    n = seq.num_tokens - num_cached if num_tokens is None else num_tokens
    if not bm.allocate_slots(seq, n, cached):
        return False
    seq.num_computed_tokens = num_cached
    compute(bm, seq, n)
    return True


def compute(bm: BlockManager, seq: Sequence, n: int) -> None:
    """What the engine does after a step computed ``n`` tokens of ``seq``."""
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)


def chain_hashes(bm: BlockManager, tokens: Seq[int]) -> list[int]:
    """The chained hash of every full block of ``tokens``, from the manager's own hash of
    (parent hash, block tokens), so that a change of hash function needs no test change."""
    hashes: list[int] = []
    for i in range(len(tokens) // bm.block_size):
        hashes.append(bm._hash(hashes[-1] if hashes else None, list(tokens), i))
    return hashes


# ------------------------------------------------------------------- allocation


def test_a_new_manager_has_every_block_free() -> None:
    bm = BlockManager(8, BS, True)
    assert bm.num_free_blocks == 8
    assert bm.usage == 0.0
    assert all(b.ref_count == 0 and b.block_hash is None for b in bm.blocks)


def test_allocation_takes_enough_blocks_for_the_tokens() -> None:
    bm = BlockManager(8, BS, True)
    seq = make_seq(range(9))
    assert bm.allocate_slots(seq, 9)
    assert len(seq.block_table) == 3  # ceil(9 / 4)
    assert bm.num_free_blocks == 5
    assert [bm.blocks[b].ref_count for b in seq.block_table] == [1, 1, 1]


def test_growing_into_a_partly_filled_block_takes_no_new_block() -> None:
    bm = BlockManager(8, BS, True)
    seq = make_seq(range(5))
    assert admit(bm, seq)
    seq.token_ids += [5, 6, 7]
    assert bm.allocate_slots(seq, 3)
    assert len(seq.block_table) == 2
    compute(bm, seq, 3)
    seq.token_ids.append(8)
    assert bm.allocate_slots(seq, 1)
    assert len(seq.block_table) == 3


def test_a_failed_allocation_changes_nothing() -> None:
    bm = BlockManager(2, BS, True)
    seq = make_seq(range(9))
    assert not bm.allocate_slots(seq, 9)
    assert seq.block_table == []
    assert bm.num_free_blocks == 2
    assert list(bm.free_queue) == [0, 1]


def test_never_used_blocks_are_handed_out_in_id_order() -> None:
    bm = BlockManager(6, BS, False)
    a, b = make_seq(range(8), 0), make_seq(range(4), 1)
    assert bm.allocate_slots(a, 8) and bm.allocate_slots(b, 4)
    assert a.block_table == [0, 1] and b.block_table == [2]
    assert bm.fresh_from == 3


def test_fresh_from_marks_the_first_block_never_handed_out() -> None:
    bm = BlockManager(6, BS, False)
    a = make_seq(range(8), 0)
    assert bm.allocate_slots(a, 8)
    assert bm.fresh_from == 2
    bm.free(a)
    assert bm.allocate_slots(make_seq(range(8), 1), 8)  # a's blocks again
    assert bm.fresh_from == 2
    assert bm.allocate_slots(make_seq(range(4), 2), 4)
    assert bm.fresh_from == 3


# -------------------------------------------------------------- reference counts


def test_a_shared_prefix_block_counts_each_holder() -> None:
    bm = BlockManager(8, BS, True)
    a, b = make_seq(range(9), 0), make_seq(range(9), 1)
    assert admit(bm, a) and admit(bm, b)
    assert b.block_table[:2] == a.block_table[:2]
    assert [bm.blocks[x].ref_count for x in a.block_table] == [2, 2, 1]
    assert b.block_table[2] != a.block_table[2]


def test_a_block_is_free_only_once_its_last_holder_frees_it() -> None:
    bm = BlockManager(8, BS, True)
    a, b = make_seq(range(9), 0), make_seq(range(9), 1)
    assert admit(bm, a) and admit(bm, b)
    shared = a.block_table[0]
    bm.free(a)
    assert bm.blocks[shared].ref_count == 1 and shared not in bm.free_queue
    bm.free(b)
    assert bm.blocks[shared].ref_count == 0 and shared in bm.free_queue
    assert bm.num_free_blocks == 8


def test_free_empties_the_block_table_and_hashes() -> None:
    bm = BlockManager(8, BS, True)
    seq = make_seq(range(9))
    assert admit(bm, seq)
    bm.free(seq)
    assert seq.block_table == [] and seq.block_hashes == []
    bm.free(seq)  # a second free has nothing left to drop
    assert bm.num_free_blocks == 8


# ------------------------------------------------------------------- prefix cache


def test_only_computed_full_blocks_are_cached() -> None:
    bm = BlockManager(8, BS, True)
    seq = make_seq(range(10))
    assert bm.allocate_slots(seq, 10)
    compute(bm, seq, 7)  # one full block and a partial one
    assert len(seq.block_hashes) == 1
    assert bm.cached == {seq.block_hashes[0]: seq.block_table[0]}
    compute(bm, seq, 3)
    assert len(seq.block_hashes) == 2


def test_block_hashes_chain_the_parents_hash() -> None:
    bm = BlockManager(8, BS, True)
    seq = make_seq(range(8))
    assert admit(bm, seq)
    assert seq.block_hashes == chain_hashes(bm, range(8))
    assert [bm.blocks[b].block_hash for b in seq.block_table] == seq.block_hashes


def test_a_prefix_hit_returns_the_cached_blocks() -> None:
    bm = BlockManager(8, BS, True)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert admit(bm, a)
    b = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0, 0], 1)
    assert bm.find_cached_prefix(b) == a.block_table[:2]


def test_a_prefix_hit_needs_every_earlier_block_to_match() -> None:
    bm = BlockManager(8, BS, True)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert admit(bm, a)
    # The same second block after another first block is another prefix.
    b = make_seq([0, 2, 3, 4, 5, 6, 7, 8, 9], 1)
    assert bm.find_cached_prefix(b) == []


def test_a_prefix_hit_leaves_the_last_token_to_compute() -> None:
    bm = BlockManager(8, BS, True)
    a = make_seq(range(8))
    assert admit(bm, a)
    assert bm.find_cached_prefix(make_seq(range(8), 1)) == a.block_table[:1]
    assert bm.find_cached_prefix(make_seq(range(9), 2)) == a.block_table[:2]


def test_a_freed_block_is_found_again_until_it_is_reused() -> None:
    bm = BlockManager(2, BS, True)
    a = make_seq(range(5))
    assert admit(bm, a)
    block, h = a.block_table[0], a.block_hashes[0]
    bm.free(a)
    assert bm.find_cached_prefix(make_seq(range(5), 1)) == [block]
    assert admit(bm, make_seq([9] * 8, 2))  # takes both blocks
    assert bm.find_cached_prefix(make_seq(range(5), 3)) == []
    assert h not in bm.cached


def test_a_prefix_hit_revives_a_free_block() -> None:
    bm = BlockManager(4, BS, True)
    a = make_seq(range(5))
    assert admit(bm, a)
    block = a.block_table[0]
    bm.free(a)
    b = make_seq(range(5), 1)
    assert admit(bm, b)
    assert b.block_table[0] == block
    assert bm.blocks[block].ref_count == 1 and block not in bm.free_queue
    assert b.num_computed_tokens == 5


def test_reviving_cached_blocks_counts_against_the_free_pool() -> None:
    bm = BlockManager(3, BS, True)
    a = make_seq(range(9))
    assert admit(bm, a)
    bm.free(a)
    # Two cached blocks to revive plus one new: all three free blocks. Nothing to spare.
    c = make_seq(range(9), 1)
    cached = bm.find_cached_prefix(c)
    assert len(cached) == 2
    assert not bm.allocate_slots(c, 5, cached)
    assert bm.allocate_slots(c, 1, cached)


def test_prefix_caching_off_caches_and_finds_nothing() -> None:
    bm = BlockManager(8, BS, False)
    a = make_seq(range(9))
    assert admit(bm, a)
    assert bm.cached == {} and a.block_hashes == []
    assert bm.find_cached_prefix(make_seq(range(9), 1)) == []


def test_a_prompt_logprobs_request_skips_the_prefix_cache() -> None:
    bm = BlockManager(8, BS, True)
    assert admit(bm, make_seq(range(9)))
    seq = make_seq(range(9), 1, params=SamplingParams(prompt_logprobs=1))
    assert bm.find_cached_prefix(seq) == []


def test_of_two_equal_blocks_computed_apart_only_the_first_is_found() -> None:
    bm = BlockManager(2, BS, True)
    a, b = make_seq(range(4), 0), make_seq(range(4), 1)
    assert bm.allocate_slots(a, 4) and bm.allocate_slots(b, 4)  # neither found the other
    compute(bm, a, 4)
    compute(bm, b, 4)
    assert bm.cached == {a.block_hashes[0]: a.block_table[0]}
    bm.free(a)
    assert bm.allocate_slots(make_seq([7], 2), 1)  # evicts a's block
    bm.free(b)
    assert bm.find_cached_prefix(make_seq(range(5), 3)) == []


def test_lookups_count_prompt_tokens_and_hits() -> None:
    bm = BlockManager(8, BS, True)
    bm.count_lookup(9, 8)
    bm.count_lookup(3, 0)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (12, 8)
    off = BlockManager(8, BS, False)
    off.count_lookup(9, 8)
    assert (off.prefix_cache_queries, off.prefix_cache_hits) == (0, 0)


# ------------------------------------------------------------------ eviction order


def test_uncached_freed_blocks_are_reused_before_cached_ones() -> None:
    bm = BlockManager(4, BS, True)
    cached, partial = make_seq(range(4), 0), make_seq([9, 9], 1)
    assert admit(bm, cached) and admit(bm, partial)
    partial_block = partial.block_table[0]
    bm.free(cached)
    bm.free(partial)
    seq = make_seq([5], 2)
    assert bm.allocate_slots(seq, 1)
    assert seq.block_table == [partial_block]


def test_freed_blocks_are_reused_before_never_used_ones() -> None:
    bm = BlockManager(6, BS, False)
    a = make_seq(range(8))
    assert admit(bm, a)
    bm.free(a)
    b = make_seq(range(8), 1)
    assert bm.allocate_slots(b, 8)
    assert sorted(b.block_table) == [0, 1]


def test_never_used_blocks_are_taken_before_cached_ones() -> None:
    bm = BlockManager(4, BS, True)
    a = make_seq(range(4))
    assert admit(bm, a)
    bm.free(a)
    b = make_seq([9] * 8, 1)
    assert bm.allocate_slots(b, 8)
    assert b.block_table == [1, 2]
    assert 0 in bm.free_queue and bm.blocks[0].block_hash is not None


def test_cached_free_blocks_are_evicted_least_recently_freed_first() -> None:
    bm = BlockManager(3, BS, True)
    seqs = [make_seq([i] * 4, i) for i in range(3)]
    for seq in seqs:
        assert admit(bm, seq)
    for i in (1, 0, 2):
        bm.free(seqs[i])
    evictor = make_seq([7] * 8, 9)
    assert bm.allocate_slots(evictor, 8)
    assert evictor.block_table == [1, 0]
    assert list(bm.free_queue) == [2]


def test_a_freed_prefix_is_evicted_tail_first() -> None:
    bm = BlockManager(3, BS, True)
    seq = make_seq(range(13))
    assert bm.allocate_slots(seq, 12)
    compute(bm, seq, 12)
    head, middle, tail = seq.block_table
    bm.free(seq)
    assert list(bm.free_queue) == [tail, middle, head]
    evictor = make_seq([9] * 4, 1)
    assert bm.allocate_slots(evictor, 4)
    assert evictor.block_table == [tail]
    assert bm.find_cached_prefix(make_seq(range(13), 2)) == [head, middle]


def test_a_revived_block_goes_to_the_back_of_the_eviction_order() -> None:
    bm = BlockManager(3, BS, True)
    a, b = make_seq([1] * 5, 0), make_seq([2] * 4, 1)
    assert admit(bm, a) and admit(bm, b)
    a_block, b_block = a.block_table[0], b.block_table[0]
    bm.free(a)  # a's cached block is freed before b's, so it is the older ...
    bm.free(b)
    again = make_seq([1] * 5, 2)
    assert admit(bm, again)  # ... until a hit takes it back
    bm.free(again)
    cached_order = [x for x in bm.free_queue if bm.blocks[x].block_hash is not None]
    assert cached_order == [b_block, a_block]


def test_evicting_a_block_drops_its_hash() -> None:
    bm = BlockManager(1, BS, True)
    a = make_seq(range(4))
    assert admit(bm, a)
    h = a.block_hashes[0]
    bm.free(a)
    assert bm.allocate_slots(make_seq([9], 1), 1)
    assert h not in bm.cached and bm.blocks[0].block_hash is None


# ------------------------------------------------------------------------ swapping


def test_swap_out_needs_a_cpu_block_per_device_block() -> None:
    bm = BlockManager(8, BS, True, num_cpu_blocks=2)
    big, small = make_seq(range(9), 0), make_seq(range(8), 1)
    assert admit(bm, big) and admit(bm, small)
    assert not bm.can_swap_out(big)  # three blocks
    assert bm.can_swap_out(small)  # two


def test_swap_out_pairs_each_device_block_with_a_cpu_block_and_frees_it() -> None:
    bm = BlockManager(8, BS, True, num_cpu_blocks=4)
    seq = make_seq(range(9))
    assert admit(bm, seq)
    table = list(seq.block_table)
    pairs = bm.swap_out(seq)
    assert [d for d, _ in pairs] == table
    assert seq.cpu_block_table == [c for _, c in pairs]
    assert len(set(seq.cpu_block_table)) == 3 and len(bm.cpu_free) == 1
    assert seq.block_table == [] and bm.num_free_blocks == 8


def test_swap_out_keeps_the_block_hashes() -> None:
    bm = BlockManager(8, BS, True, num_cpu_blocks=4)
    seq = make_seq(range(9))
    assert admit(bm, seq)
    hashes = list(seq.block_hashes)
    bm.swap_out(seq)
    assert seq.block_hashes == hashes


def test_swap_in_needs_room_for_the_resumed_steps_tokens() -> None:
    bm = BlockManager(3, BS, True, num_cpu_blocks=4)
    seq = make_seq(range(8))
    assert admit(bm, seq)
    bm.swap_out(seq)
    assert admit(bm, make_seq([9] * 4, 1))  # two device blocks left
    seq.token_ids.append(8)
    assert bm.can_swap_in(seq, 0)
    assert not bm.can_swap_in(seq, 1)  # the ninth token needs a third block


def test_swap_in_restores_the_blocks_and_returns_the_cpu_ones() -> None:
    bm = BlockManager(8, BS, True, num_cpu_blocks=4)
    seq = make_seq(range(9))
    assert admit(bm, seq)
    bm.swap_out(seq)
    cpu = list(seq.cpu_block_table)
    pairs = bm.swap_in(seq)
    assert [c for c, _ in pairs] == cpu
    assert seq.block_table == [d for _, d in pairs]
    assert seq.cpu_block_table == [] and sorted(bm.cpu_free) == [0, 1, 2, 3]
    assert [bm.blocks[b].ref_count for b in seq.block_table] == [1, 1, 1]


def test_free_cpu_returns_a_swapped_sequences_cpu_blocks() -> None:
    bm = BlockManager(8, BS, True, num_cpu_blocks=4)
    seq = make_seq(range(9))
    assert admit(bm, seq)
    bm.swap_out(seq)
    bm.free_cpu(seq)
    assert seq.cpu_block_table == [] and sorted(bm.cpu_free) == [0, 1, 2, 3]


# ---------------------------------------------------------------- the state model


class KVShadow:
    """What the engine would have written into the paged cache: the token in each slot of
    each device and CPU block, the whole prefix each hashed block was registered for, and
    when each block was last freed (the clock the eviction order is checked against).

    Call ``before`` with every sequence ahead of an operation on the manager and ``after``
    once it is done; ``write`` stands for a forward pass computing tokens.
    """

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        bs = bm.block_size
        self.device: list[list[int | None]] = [[None] * bs for _ in range(bm.num_blocks)]
        self.cpu: list[list[int | None]] = [[None] * bs for _ in range(bm.num_cpu_blocks)]
        self.prefix: dict[int, tuple[int, ...]] = {}
        self.freed_at: dict[int, int] = {}
        self.clock = 0
        self._tables: dict[int, list[int]] = {}
        self._held: set[tuple[int, int]] = set()
        self._free: set[int] = set()
        self._hashes: list[int | None] = []

    def before(self, seqs: Iterable[Sequence]) -> None:
        seqs = list(seqs)
        self._tables = {id(s): list(s.block_table) for s in seqs}
        self._held = {(id(s), b) for s in seqs for b in s.block_table}
        self._free = set(self.bm.free_queue)
        self._hashes = [b.block_hash for b in self.bm.blocks]

    def after(self, seqs: Iterable[Sequence], released: Iterable[Sequence] = (),
              swap_out: Iterable[tuple[int, int]] = (),
              swap_in: Iterable[tuple[int, int]] = ()) -> None:
        """``released``: the sequences whose blocks the operation dropped, in the order it
        dropped them. The swaps' copies run before anything is written, as the runner's."""
        bm, bs = self.bm, self.bm.block_size
        seqs = list(seqs)
        for dev, cpu in swap_out:
            self.cpu[cpu] = list(self.device[dev])
        self._check_evictions()
        for seq in seqs:
            for b in seq.block_table:
                if (id(seq), b) not in self._held and bm.blocks[b].block_hash is None:
                    self.device[b] = [None] * bs  # a new holder writes it afresh
        for cpu, dev in swap_in:
            self.device[dev] = list(self.cpu[cpu])
        for block in bm.blocks:
            if block.block_hash is None:
                self.prefix.pop(block.block_id, None)
        released = list(released)
        # A sequence may fill a block and finish in one step: its old table names the block.
        tables = [(s, s.block_table) for s in seqs]
        tables += [(s, self._tables.get(id(s), [])) for s in released]
        for seq, table in tables:
            for i, b in enumerate(table):
                if bm.blocks[b].block_hash is not None and b not in self.prefix:
                    self.prefix[b] = tuple(seq.token_ids[:(i + 1) * bs])
        self._stamp_freed(released)

    def _check_evictions(self) -> None:
        """A cached block taken for reuse was the least recently freed of the cached free
        blocks: every cached block left free was freed after it."""
        bm = self.bm
        now_free = set(bm.free_queue)
        was_cached = {b for b in self._free if self._hashes[b] is not None}
        evicted = {b for b in was_cached - now_free if bm.blocks[b].block_hash is None}
        for e in evicted:
            older = sorted(k for k in was_cached & now_free
                           if self.freed_at[k] < self.freed_at[e])
            assert not older, f"evicted cached block {e} before the older {older}"

    def _stamp_freed(self, released: Iterable[Sequence]) -> None:
        """A block is freed when its last holder drops it; a sequence drops its blocks
        tail first."""
        order = [b for s in released for b in reversed(self._tables.get(id(s), []))]
        last = {b: i for i, b in enumerate(order)}
        now_free = set(self.bm.free_queue)
        newly = now_free - self._free
        assert newly <= last.keys(), f"blocks {sorted(newly - last.keys())} freed by no one"
        for b in sorted(newly, key=last.__getitem__):
            self.clock += 1
            self.freed_at[b] = self.clock
        for b in self._free - now_free:
            self.freed_at.pop(b, None)  # never-used blocks have no stamp

    def write(self, seq: Sequence, start: int, end: int) -> None:
        """A forward pass computes positions ``start`` to ``end`` of ``seq`` into its
        blocks."""
        bs = self.bm.block_size
        for p in range(start, end):
            self.device[seq.block_table[p // bs]][p % bs] = seq.token_ids[p]


def check_block_manager(bm: BlockManager, shadow: KVShadow, seqs: Iterable[Sequence]) -> None:
    """Every invariant of the manager, given every sequence that may hold blocks."""
    seqs = list(seqs)
    bs, n = bm.block_size, bm.num_blocks
    queue = list(bm.free_queue)

    # Free plus used is the whole pool, and no block is both.
    free = set(queue)
    used = {b.block_id for b in bm.blocks if b.ref_count > 0}
    assert len(free) == len(queue) == bm.num_free_blocks
    assert not free & used, f"blocks {sorted(free & used)} are both free and used"
    assert free | used == set(range(n)), f"blocks {sorted(set(range(n)) - free - used)} lost"

    # Reference counts are the number of holders.
    holders: dict[int, int] = {}
    for s in seqs:
        assert len(set(s.block_table)) == len(s.block_table), f"{s.seq_id} holds a block twice"
        for b in s.block_table:
            holders[b] = holders.get(b, 0) + 1
    for block in bm.blocks:
        assert block.ref_count >= 0
        assert block.ref_count == holders.get(block.block_id, 0), (
            f"block {block.block_id}: ref_count {block.ref_count}, "
            f"{holders.get(block.block_id, 0)} holders")

    # CPU blocks: free plus held is the whole swap space, each once.
    cpu_held = [c for s in seqs for c in s.cpu_block_table]
    assert sorted(cpu_held + bm.cpu_free) == list(range(bm.num_cpu_blocks))

    # Prefix hashes: a hashed block holds the last block of the prefix its hash chains,
    # and the map from hashes finds blocks with that hash.
    for h, b in bm.cached.items():
        assert bm.blocks[b].block_hash == h
    for block in bm.blocks:
        if block.block_hash is not None:
            prefix = shadow.prefix[block.block_id]
            assert chain_hashes(bm, prefix)[-1] == block.block_hash
            assert shadow.device[block.block_id] == list(prefix[-bs:])
    for s in seqs:
        assert len(s.block_hashes) <= s.num_computed_tokens // bs
        assert s.block_hashes == chain_hashes(bm, s.token_ids[:len(s.block_hashes) * bs])
        for i, b in enumerate(s.block_table):
            h = bm.blocks[b].block_hash
            if h is not None:
                assert i < len(s.block_hashes) and h == s.block_hashes[i]
                assert shadow.prefix[b] == tuple(s.token_ids[:(i + 1) * bs])

    # The cache holds every computed token where the sequence's table says.
    for s in seqs:
        if not s.block_table and not s.cpu_block_table:
            continue
        assert not (s.block_table and s.cpu_block_table), f"{s.seq_id}: device or CPU?"
        table, store = ((s.block_table, shadow.device) if s.block_table
                        else (s.cpu_block_table, shadow.cpu))
        assert len(table) >= bm.blocks_needed(s.num_computed_tokens)
        got = [store[table[p // bs]][p % bs] for p in range(s.num_computed_tokens)]
        assert got == s.token_ids[:s.num_computed_tokens], f"{s.seq_id}'s cache is wrong"

    # The free queue's order is the reuse order: blocks freed uncached, then never-used
    # blocks in id order, then cached blocks, least recently freed first.
    unhashed = [b for b in queue if bm.blocks[b].block_hash is None]
    hashed = [b for b in queue if bm.blocks[b].block_hash is not None]
    assert queue == unhashed + hashed, "a cached block would be reused before an uncached one"
    fresh = list(range(bm.fresh_from, n))
    reused = unhashed[:len(unhashed) - len(fresh)]
    assert unhashed[len(reused):] == fresh, "never-used blocks out of id order"
    assert all(b < bm.fresh_from for b in reused)
    stamps = [shadow.freed_at[b] for b in hashed]
    assert stamps == sorted(stamps), "cached blocks out of the order they were freed in"


STEMS = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
         [1, 2, 3, 4, 9, 9, 9, 9, 5, 6, 7, 8],
         [5, 6, 7, 8, 1, 2, 3, 4, 1, 2, 3, 4])
# Prompts share heads often, so that prefix hits, shared blocks and evictions are common.
PROMPTS = st.builds(lambda stem, cut, tail: STEMS[stem][:cut] + tail,
                    st.integers(0, len(STEMS) - 1), st.integers(0, 12),
                    st.lists(st.integers(0, 3), min_size=1, max_size=6))
PICK = st.integers(0, 1 << 16)  # an index into a list, taken modulo its length


class BlockManagerMachine(RuleBasedStateMachine):
    """Sequences start (taking their cached prefix), grow, share prefixes, finish, and
    are preempted by recomputation or by swapping out and in, as the scheduler drives
    them; the manager must stay consistent with ``KVShadow`` after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.running: list[Sequence] = []
        self.waiting: list[Sequence] = []  # preempted for recomputation
        self.swapped: list[Sequence] = []
        self.everyone: list[Sequence] = []
        self.next_id = 0

    @initialize(num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 2, 4]),
                caching=st.booleans(), num_cpu_blocks=st.integers(0, 8))
    def setup(self, num_blocks: int, block_size: int, caching: bool,
              num_cpu_blocks: int) -> None:
        self.bm = BlockManager(num_blocks, block_size, caching, num_cpu_blocks)
        self.shadow = KVShadow(self.bm)

    def _new_seq(self, tokens: list[int]) -> Sequence:
        seq = make_seq(tokens, self.next_id)
        self.next_id += 1
        self.everyone.append(seq)
        return seq

    def _start(self, seq: Sequence, chunk: int) -> bool:
        bm = self.bm
        self.shadow.before(self.everyone)
        cached = bm.find_cached_prefix(seq)
        num_cached = len(cached) * bm.block_size
        n = min(seq.num_tokens - num_cached, chunk)
        if not bm.allocate_slots(seq, n, cached):
            assert seq.block_table == []
            self.shadow.after(self.everyone)
            return False
        seq.num_computed_tokens = num_cached
        self.running.append(seq)
        self.shadow.after(self.everyone)
        self._compute(seq, n)
        return True

    def _compute(self, seq: Sequence, n: int) -> None:
        self.shadow.before(self.everyone)
        self.shadow.write(seq, seq.num_computed_tokens, seq.num_computed_tokens + n)
        compute(self.bm, seq, n)
        self.shadow.after(self.everyone)

    @rule(prompt=PROMPTS, chunk=st.integers(1, 16))
    def start(self, prompt: list[int], chunk: int) -> None:
        self._start(self._new_seq(prompt), chunk)

    @precondition(lambda self: self.everyone)
    @rule(i=PICK, cut=st.integers(1, 24), tail=st.lists(st.integers(0, 3), max_size=3))
    def fork(self, i: int, cut: int, tail: list[int]) -> None:
        """A sequence that starts with another's tokens shares its cached blocks."""
        parent = self.everyone[i % len(self.everyone)]
        self._start(self._new_seq(parent.token_ids[:cut] + tail), 64)

    @precondition(lambda self: self.running)
    @rule(i=PICK, n=st.integers(1, 9), token=st.integers(0, 3))
    def grow(self, i: int, n: int, token: int) -> None:
        """Compute up to ``n`` more tokens; a sequence with all computed samples one."""
        seq = self.running[i % len(self.running)]
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(token)
        n = min(n, seq.num_tokens - seq.num_computed_tokens)
        self.shadow.before(self.everyone)
        ok = self.bm.allocate_slots(seq, n)
        self.shadow.after(self.everyone)
        if ok:
            self._compute(seq, n)

    def _release(self, seq: Sequence, release) -> list[tuple[int, int]]:  # noqa: ANN001
        self.shadow.before(self.everyone)
        pairs = release(seq) or []
        self.shadow.after(self.everyone, released=[seq], swap_out=pairs)
        return pairs

    @precondition(lambda self: self.running)
    @rule(i=PICK)
    def finish(self, i: int) -> None:
        self._release(self.running.pop(i % len(self.running)), self.bm.free)

    @precondition(lambda self: self.running)
    @rule(i=PICK)
    def preempt_by_recompute(self, i: int) -> None:
        seq = self.running.pop(i % len(self.running))
        self._release(seq, self.bm.free)
        seq.reset_for_recompute()
        self.waiting.append(seq)

    @precondition(lambda self: self.waiting)
    @rule(i=PICK, chunk=st.integers(1, 16))
    def resume_recomputed(self, i: int, chunk: int) -> None:
        seq = self.waiting.pop(i % len(self.waiting))
        if not self._start(seq, chunk):
            self.waiting.append(seq)

    @precondition(lambda self: self.running and self.bm.num_cpu_blocks)
    @rule(i=PICK)
    def preempt_by_swap(self, i: int) -> None:
        seq = self.running[i % len(self.running)]
        if not self.bm.can_swap_out(seq):
            return
        self.running.remove(seq)
        self._release(seq, self.bm.swap_out)
        self.swapped.append(seq)

    @precondition(lambda self: self.swapped)
    @rule(i=PICK, n=st.integers(1, 9), token=st.integers(0, 3))
    def swap_back_in(self, i: int, n: int, token: int) -> None:
        bm = self.bm
        seq = self.swapped[i % len(self.swapped)]
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(token)
        n = min(n, seq.num_tokens - seq.num_computed_tokens)
        if not bm.can_swap_in(seq, n):
            return
        self.swapped.remove(seq)
        self.shadow.before(self.everyone)
        pairs = bm.swap_in(seq)
        assert bm.allocate_slots(seq, n), "can_swap_in promised room for the new tokens"
        self.shadow.after(self.everyone, swap_in=pairs)
        self.running.append(seq)
        self._compute(seq, n)

    @precondition(lambda self: self.swapped)
    @rule(i=PICK)
    def abort_swapped(self, i: int) -> None:
        seq = self.swapped.pop(i % len(self.swapped))
        self.bm.free_cpu(seq)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "bm"):
            return
        check_block_manager(self.bm, self.shadow, self.everyone)
        for seq in self.waiting:
            assert not seq.block_table and not seq.cpu_block_table and not seq.block_hashes
        for seq in self.swapped:
            assert not seq.block_table
            assert len(seq.cpu_block_table) >= self.bm.blocks_needed(seq.num_computed_tokens)
        for seq in self.running:
            assert not seq.cpu_block_table
            assert len(seq.block_table) >= self.bm.blocks_needed(seq.num_computed_tokens)

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for seq in self.running:
            self.bm.free(seq)
        for seq in self.swapped:
            self.bm.free_cpu(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert len(self.bm.cpu_free) == self.bm.num_cpu_blocks


def test_random_operations_keep_the_block_manager_consistent() -> None:
    run_state_machine_as_test(BlockManagerMachine, settings=settings(
        max_examples=150, stateful_step_count=40, deadline=None, derandomize=True,
        database=None, suppress_health_check=[HealthCheck.too_slow]))
