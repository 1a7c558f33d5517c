"""Plain-torch layers against the formulas they shortcut."""

from __future__ import annotations

import pytest
import torch

from rvllm import forward_context
from rvllm.forward_context import AttentionMetadata, set_forward_context
from rvllm.layers.attention import Attention
from rvllm.layers.norm import RMSNorm


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def test_float32_rms_norm_is_bit_identical_to_the_explicit_formula() -> None:
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, eps=1e-5)
    norm.weight.data = torch.randn(96, generator=gen)
    for rows in (1, 7, 300):
        x, residual = torch.randn(rows, 96, generator=gen), torch.randn(rows, 96, generator=gen)
        assert torch.equal(norm(x), reference_rms_norm(x, norm.weight, 1e-5))
        out, summed = norm(x, residual)
        assert torch.equal(summed, residual + x)
        assert torch.equal(out, reference_rms_norm(residual + x, norm.weight, 1e-5))


def decode_metadata(lens: list[int]) -> AttentionMetadata:
    slots = torch.zeros(len(lens), max(lens), dtype=torch.long)
    return AttentionMetadata(torch.zeros(len(lens), dtype=torch.long), len(lens), slots,
                             torch.tensor(lens), [])


def test_decode_mask_is_none_when_every_row_attends_to_everything() -> None:
    assert decode_metadata([5, 5, 5]).decode_mask(None, torch.float32) is None
    # A window shorter than the context masks the oldest positions.
    window = decode_metadata([5, 5]).decode_mask(3, torch.float32)
    assert window is not None and window[0, 0, 0].tolist() == [-torch.inf] * 2 + [0.0] * 3


def test_decode_mask_is_additive_minus_inf_past_each_rows_length() -> None:
    mask = decode_metadata([2, 4]).decode_mask(None, torch.float32)
    assert mask is not None and mask.shape == (2, 1, 1, 4) and mask.dtype == torch.float32
    assert mask[0, 0, 0].tolist() == [0.0, 0.0, -torch.inf, -torch.inf]
    assert mask[1, 0, 0].tolist() == [0.0] * 4


def decode_step(lens: list[int], block_size: int = 4) -> AttentionMetadata:
    """Decode metadata for sequences laid out one after another in the cache, in reverse
    block order (so a kernel that ignored the block tables would read the wrong keys)."""
    rows, tables, start = [], [], 0
    max_blocks = -(-max(lens) // block_size)
    for n in lens:
        blocks = -(-n // block_size)
        table = start + torch.arange(blocks - 1, -1, -1)
        tables.append(torch.cat([table, torch.zeros(max_blocks - blocks, dtype=torch.long)]))
        pos = torch.minimum(torch.arange(max(lens)), torch.tensor(n - 1))
        rows.append(table[pos // block_size] * block_size + pos % block_size)
        start += blocks
    slots = torch.stack(rows)
    return AttentionMetadata(slots[:, -1].clone(), len(lens), slots, torch.tensor(lens), [],
                             decode_block_tables=torch.stack(tables))


def reference_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     slots: torch.Tensor, n: int, scale: float, window: int | None,
                     cap: float | None) -> torch.Tensor:
    """One sequence, written out: q [Hq, D] against its first n slots."""
    first = 0 if window is None else max(0, n - window)
    k, v = keys[slots[first:n]], values[slots[first:n]]  # [L, Hk, D]
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,lhd->hl", q, k) * scale
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    return torch.einsum("hl,lhd->hd", torch.softmax(scores, -1), v)


@pytest.mark.parametrize("window, cap", [(None, None), (5, None), (None, 30.0)])
@pytest.mark.parametrize("ragged", [True, False])
@pytest.mark.parametrize("kernel_backend", ["torch"], indirect=True)
def test_decode_attention_matches_each_sequence_written_out(
        window: int | None, cap: float | None, ragged: bool, kernel_backend: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Ragged: one call per sequence over its own slots; padded: one masked batched call.
    monkeypatch.setattr(forward_context, "RAGGED_MIN_PADDING_PER_ROW", 0 if ragged else 10**9)
    check_decode_attention([3, 17, 9, 1], window, cap)
    assert (decode_step([3, 17, 9, 1]).ragged_decode() is not None) == ragged


@pytest.mark.parametrize("window, cap", [(None, None), (5, None), (None, 30.0)])
@pytest.mark.parametrize("lens", [[3, 17, 9, 1], [30], [2, 64]])
@pytest.mark.parametrize("kernel_backend", ["numba"], indirect=True)
def test_numba_decode_attention_matches_each_sequence_written_out(
        window: int | None, cap: float | None, lens: list[int], kernel_backend: str) -> None:
    # One sequence (or two on two threads) splits its context across the threads.
    check_decode_attention(lens, window, cap)


@pytest.mark.parametrize("window, cap", [(None, None), (21, None), (None, 30.0)])
@pytest.mark.parametrize("block_size", [4, 16, 40])
@pytest.mark.parametrize("kernel_backend", ["numba"], indirect=True)
def test_numba_decode_attention_on_16_lane_vectors_matches_each_sequence_written_out(
        window: int | None, cap: float | None, block_size: int, kernel_backend: str) -> None:
    # Head dimensions that are multiples of 16 take vectors: runs of 1-16 tokens, and
    # blocks of more than 16 tokens in several runs.
    check_decode_attention([3, 17, 9, 1, 70, 33], window, cap, head_dim=32,
                           block_size=block_size)


@pytest.mark.parametrize("num_splits", [1, 2, 3])
@pytest.mark.parametrize("lens", [[30], [3, 17, 9], [3, 17, 9, 1, 70, 33]])
def test_numba_decode_attention_at_any_split_count_matches_each_sequence_written_out(
        num_splits: int, lens: list[int]) -> None:
    # Unsplit, each work item writes its sequence's result; split, up to MERGE_HERE
    # sequences are merged on the calling thread, more in a parallel loop.
    import numpy as np

    from rvllm.kernels.cpu.decode_attention import MERGE_HERE, paged_decode_attention_cpu

    assert 3 <= MERGE_HERE < 6  # the cases take both ways
    gen = torch.Generator().manual_seed(2)
    md = decode_step(lens, 16)
    num_blocks = sum(-(-n // 16) for n in lens) + 1
    cache = torch.randn(2, num_blocks, 16, 2, 32, generator=gen)
    q = torch.randn(len(lens), 6, 32, generator=gen)
    tables = md.decode_block_tables.to(torch.int64).numpy()
    got = paged_decode_attention_cpu(
        q, cache[0], cache[1], md.decode_block_tables, torch.tensor(lens), 32**-0.5, None,
        None, arrays=(tables, np.array(lens, np.int64), np.int64(num_splits)))
    keys, values = cache[0].view(-1, 2, 32), cache[1].view(-1, 2, 32)
    for i, n in enumerate(lens):
        want = reference_decode(q[i], keys, values, md.decode_slots[i], n, 32**-0.5, None, None)
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 2, 3])
@pytest.mark.parametrize("head_dim, window", [(32, 0), (8, 0), (32, 31)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_numba_decode_attention_of_one_sequences_consecutive_rows_matches_each_row_written_out(
        num_splits: int, head_dim: int, window: int, kv_dtype: torch.dtype) -> None:
    # A verifying step's rows: a speculating sequence's last token and drafts at
    # consecutive positions over one block table, each row seeing only the positions up
    # to its own. Rows 0-3: one sequence across a block boundary; rows 4-5 share its
    # first block (a prefix hit) but not the rest; row 6 alone; rows 7-8 another
    # sequence.
    import numpy as np

    from rvllm.kernels.cpu.decode_attention import paged_decode_attention_cpu

    bs = 16
    a, b, c, d = [5, 9, 2, 7], [5, 3, 11, 12], [4], [0, 1]
    rows = [(a, 30), (a, 31), (a, 32), (a, 33), (b, 34), (b, 35), (c, 10), (d, 20), (d, 21)]
    tables = np.zeros((len(rows), 4), np.int64)
    for i, (blocks, _) in enumerate(rows):
        tables[i, :len(blocks)] = blocks
    lens = np.array([n for _, n in rows], np.int64)
    gen = torch.Generator().manual_seed(4)
    cache = torch.randn(2, 13, bs, 2, head_dim, generator=gen).to(kv_dtype)
    q = torch.randn(len(rows), 6, head_dim, generator=gen)
    got = paged_decode_attention_cpu(
        q, cache[0], cache[1], torch.from_numpy(tables), torch.from_numpy(lens),
        head_dim**-0.5, window, None, arrays=(tables, lens, np.int64(num_splits)))
    keys, values = (cache[i].float().view(-1, 2, head_dim) for i in (0, 1))
    for i, (blocks, n) in enumerate(rows):
        slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(n)])
        want = reference_decode(q[i], keys, values, slots, n, head_dim**-0.5, window or None,
                                None)
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [2, 3, 5])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_numba_decode_attention_shares_items_out_once_each_and_evenly(
        threads: int, num_splits: int) -> None:
    # With more items than threads, each thread walks its own list of items: every item
    # is in exactly one list, and no thread ends up with more than the least loaded plus
    # one item's work (the longest items are handed out first).
    import numpy as np

    from rvllm.kernels.cpu.decode_attention import ITEM_OVERHEAD, _share_out, split_range

    lens = np.array([700, 33, 512, 1, 90, 90, 256, 17, 400, 64, 5], np.int64)
    order, starts = _share_out(lens, np.int64(0), np.int64(16), np.int64(num_splits),
                               np.int64(threads))
    items = len(lens) * num_splits
    assert sorted(order.tolist()) == list(range(items))
    assert starts[0] == 0 and starts[-1] == items and len(starts) == threads + 1

    def cost(item: int) -> int:
        _, _, lo, hi = split_range(lens[item // num_splits], 0, 16, num_splits,
                                   item % num_splits)
        return max(hi - lo, 0) + ITEM_OVERHEAD

    loads = [sum(cost(i) for i in order[starts[t]:starts[t + 1]]) for t in range(threads)]
    assert max(loads) - min(loads) <= max(cost(i) for i in range(items))


def check_decode_attention(lens: list[int], window: int | None, cap: float | None,
                           head_dim: int = 8, block_size: int = 4) -> None:
    gen = torch.Generator().manual_seed(1)
    md = decode_step(lens, block_size)
    d = head_dim
    attn = Attention(num_heads=6, head_dim=d, num_kv_heads=2, scale=d**-0.5,
                     sliding_window=window, logits_soft_cap=cap)
    num_blocks = sum(-(-n // block_size) for n in lens) + 1
    cache = torch.randn(2, num_blocks, block_size, 2, d, generator=gen)
    attn.kv_cache = (cache[0], cache[1])
    q = torch.randn(len(lens), 6, d, generator=gen)
    k, v = torch.randn(len(lens), 2, d, generator=gen), torch.randn(len(lens), 2, d, generator=gen)
    with set_forward_context(md):
        got = attn(q, k, v).view(len(lens), 6, d)
    keys, values = cache[0].view(-1, 2, d), cache[1].view(-1, 2, d)
    for i, n in enumerate(lens):
        want = reference_decode(q[i], keys, values, md.decode_slots[i], n, d**-0.5, window, cap)
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel_backend", ["numba"], indirect=True)
def test_numba_kernels_take_as_many_threads_as_torch(kernel_backend: str) -> None:
    # A tensor-parallel rank or a data-parallel replica gets a share of the cores.
    import numba

    from rvllm.kernels.cpu.threads import match_torch_threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        check_decode_attention([3, 17, 9, 1], None, None)
        assert numba.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
        match_torch_threads()


def prefill_step(context_len: int, n: int, block_size: int = 4
                 ) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata of one prefill chunk of n tokens after context_len cached ones, its
    positions' slots in reverse block order; and those slots."""
    from rvllm.forward_context import PrefillSeq

    total = context_len + n
    blocks = -(-total // block_size)
    table = torch.arange(blocks - 1, -1, -1)
    pos = torch.arange(total)
    slots = table[pos // block_size] * block_size + pos % block_size
    md = AttentionMetadata(slots[context_len:].clone(), 0, None, None,
                           [PrefillSeq(0, n, context_len, slots)])
    return md, slots


@pytest.mark.parametrize("window, cap", [(None, None), (7, None), (None, 30.0)])
@pytest.mark.parametrize("context_len, n", [(0, 1), (0, 5), (0, 40), (20, 13), (3, 2)])
@pytest.mark.parametrize("head_dim", [8, 32])
@pytest.mark.parametrize("kernel_backend", ["torch", "numba"], indirect=True)
def test_prefill_attention_matches_each_query_written_out(
        window: int | None, cap: float | None, context_len: int, n: int, head_dim: int,
        kernel_backend: str) -> None:
    # Under numba, head dimensions that are multiples of 16 without a soft cap take
    # prefill_attention; the rest, and the torch backend, SDPA.
    gen = torch.Generator().manual_seed(3)
    md, slots = prefill_step(context_len, n)
    d = head_dim
    attn = Attention(num_heads=6, head_dim=d, num_kv_heads=2, scale=d**-0.5,
                     sliding_window=window, logits_soft_cap=cap)
    num_blocks = -(-(context_len + n) // 4)
    cache = torch.randn(2, num_blocks, 4, 2, d, generator=gen)
    attn.kv_cache = (cache[0], cache[1])
    q = torch.randn(n, 6, d, generator=gen)
    k, v = torch.randn(n, 2, d, generator=gen), torch.randn(n, 2, d, generator=gen)
    with set_forward_context(md):
        got = attn(q, k, v).view(n, 6, d)
    keys, values = cache[0].view(-1, 2, d), cache[1].view(-1, 2, d)
    for i in range(n):
        want = reference_decode(q[i], keys, values, slots, context_len + i + 1, d**-0.5,
                                window, cap)
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("context_len, n, window", [(0, 290, None), (100, 77, None),
                                                    (0, 50, 19), (37, 40, 24)])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 2), (2, 2)])
def test_numba_prefill_attention_over_many_tiles_matches_sdpa(
        context_len: int, n: int, window: int | None, heads: int, kv_heads: int) -> None:
    # SmolLM2's heads (9 query heads on 3 KV heads, 64 wide), and groups of 2 and 1
    # (32 and 16 rows an item: blocks of six rows, then pairs): query tiles of 16
    # positions, the last one partial, against tiles of 16 keys, the window starting
    # inside one.
    from rvllm.forward_context import PrefillSeq
    from rvllm.kernels.cpu.prefill_attention import prefill_attention_cpu

    gen = torch.Generator().manual_seed(4)
    total = context_len + n
    q = torch.randn(n, heads, 64, generator=gen)
    keys = torch.randn(total, kv_heads, 64, generator=gen)
    values = torch.randn(total, kv_heads, 64, generator=gen)
    got = prefill_attention_cpu(q, keys, values, context_len, 0.125, window).view(n, heads,
                                                                                  64)
    mask = PrefillSeq(0, n, context_len, torch.arange(total)).mask(window)
    if mask is None:
        mask = torch.ones(n, total, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask,
        scale=0.125, enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
