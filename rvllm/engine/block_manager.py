"""The paged KV cache's bookkeeping: which blocks each sequence holds, and the prefix cache.

Blocks are reference counted. A block whose count drops to zero goes to the
back of the free queue but keeps its contents and hash, so a later request with
the same prefix can take it back (a prefix-cache hit) until it is reused for
something else; eviction takes from the front, least recently freed first.
A full block's hash chains its parent's hash with its own token ids, so equal
hashes mean equal whole prefixes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from rvllm.engine.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 num_cpu_blocks: int = 0) -> None:
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Blocks [fresh_from, num_blocks) have never been handed out: the free queue
        # starts in id order, and a freed block goes back before them or after them, so
        # they leave it in id order (their cache memory is first written then).
        self.fresh_from = 0
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of which found in the cache

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of ``seq``. At least one token is
        always left to compute, since its logits are what the next sample needs."""
        if not self.enable_prefix_caching or seq.needs_every_prompt_row:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hit: list[int] = []
        parent: int | None = None
        for i in range(max_blocks):
            h = self._hash(parent, seq.token_ids, i, seq.lora_id)
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hit.append(block_id)
            parent = h
        return hit

    def count_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Record one admitted lookup for the prefix-cache hit-rate metrics."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       cached_blocks: list[int] | None = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``seq`` (after any cached
        prefix blocks, which it takes a reference on). False when the pool is too small."""
        cached_blocks = cached_blocks or []
        have = len(seq.block_table) + len(cached_blocks)
        num_computed = seq.num_computed_tokens + len(cached_blocks) * self.block_size
        new = max(0, self.blocks_needed(num_computed + num_new_tokens) - have)
        revived = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if new + revived > self.num_free_blocks:
            return False
        for b in cached_blocks:
            block = self.blocks[b]
            if block.ref_count == 0:
                del self.free_queue[b]
            block.ref_count += 1
        if cached_blocks:
            seq.block_table.extend(cached_blocks)
            seq.block_hashes = [self.blocks[b].block_hash for b in cached_blocks]  # type: ignore[misc]
        for _ in range(new):
            seq.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        self.fresh_from = max(self.fresh_from, block_id + 1)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references. Its tail blocks go to the free queue first, so
        that the shared head of a prefix is the last to be evicted."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    # Nothing to find again: reuse it before any cached block.
                    self.free_queue[block_id] = None
                    self.free_queue.move_to_end(block_id, last=False)
                else:
                    self.free_queue[block_id] = None
        seq.block_table = []
        seq.block_hashes = []

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that the last step filled completely: computed, and every
        token known (with a step in flight, ``engine.async_steps``, the computed count
        runs ahead of the tokens taken)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, len(seq.token_ids)) // self.block_size
        while len(seq.block_hashes) < num_full:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = self._hash(parent, seq.token_ids, i, seq.lora_id)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None:
                block.block_hash = h
                self.cached.setdefault(h, block.block_id)

    def _hash(self, parent: int | None, token_ids: list[int], i: int, lora_id: int = 0
              ) -> int:
        """Block ``i``'s hash: its tokens and every block's before it, and the sequence's
        LoRA adapter (another adapter's keys and values differ)."""
        bs = self.block_size
        if parent is None and lora_id:
            parent = hash(("lora", lora_id))
        return hash((parent, tuple(token_ids[i * bs:(i + 1) * bs])))

    # ------------------------------------------------------------------ swapping

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= len(self.cpu_free)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move ``seq``'s blocks to CPU swap space; returns (device, cpu) block pairs to copy
        before anything reuses the device blocks."""
        pairs = [(b, self.cpu_free.pop()) for b in seq.block_table]
        hashes = seq.block_hashes
        self.free(seq)
        seq.block_hashes = hashes  # the tokens, and so the hashes, are unchanged
        seq.cpu_block_table = [cpu for _, cpu in pairs]
        return pairs

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Room for its blocks plus those the resumed step's new tokens need."""
        total = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        return max(total, len(seq.cpu_block_table)) <= self.num_free_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring ``seq`` back onto fresh device blocks; returns (cpu, device) pairs to copy."""
        pairs = [(cpu, self._take_free_block()) for cpu in seq.cpu_block_table]
        seq.block_table = [dev for _, dev in pairs]
        self.free_cpu(seq)
        return pairs

    def free_cpu(self, seq: Sequence) -> None:
        self.cpu_free.extend(reversed(seq.cpu_block_table))
        seq.cpu_block_table = []
