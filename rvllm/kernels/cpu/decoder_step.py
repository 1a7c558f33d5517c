"""A decode step of a few sequences through a whole Llama-shaped decoder stack in one
numba call.

A decode step of one sequence reads every weight once and does little arithmetic on
each, so the linear layers alone (``gemv``) took about half of the step on this
class of CPU; the other half was the ~50 torch operations per layer around them (norms,
RoPE, the cache write, attention, SiLU*mul, the residual adds) and the Python that
drives them, each a few microseconds on a few rows. Here the whole stack runs in
compiled code: per layer, RMSNorm, the QKV projection, RoPE, the KV-cache write,
attention over the paged cache, the output projection, the residual add and RMSNorm,
gate/up with SiLU*mul fused into its rows, and the down projection. Each weight row is
read from memory once for all the step's sequences.

A one-row step (N=1 decode, bound by the memory) runs in one parallel region of numba's
threads (as many as torch's) for the whole step (``_one_region``, ``sync``): each
projection's shares and each layer's attention are work items any free thread claims,
and whichever thread ends a phase's last item does the few thousand floats of serial
work after it (RoPE and the cache write, a residual add and a norm). A ``prange`` loop
a projection cost about 150 forks and joins a step. A thread that is done with its share
claims its share of the next projection before it waits, and asks the memory for that
share's first lines meanwhile (``_wait_fetching``): the threads end a phase up to tens
of microseconds apart, and the waiting one had left its half of the memory's bandwidth
idle. Steps of more rows (bound by arithmetic) take a ``prange`` loop a projection and
attention, the rest on the calling thread (``_by_op``): the region was slower there
with float32 weights. Packed weights' steps of up to ``REGION_ROWS_PACKED`` rows (a
speculative step's verifying rows, a few sequences) take the region too: their integer
products are quick enough that a ``prange`` loop's fork and join, about 150 a step, cost
SmolLM2 a verifying step of 5 rows 17.4-19.6 ms against 16.1-17.1 in the region, and a
step of 2 rows 6.5-7.4 against 6.0-6.4 (2-vCPU Xeon, alternated; 4 and 8 rows alike).

Up to ``MAX_ROWS`` sequences with float32 weights, ``MAX_ROWS_INT8`` with int8: measured
on the random Llama (2 cores), past those the packed GEMMs win (fbgemm's int8 GEMMs
quantize the activations too; here every int8 weight is widened to float32), and
``batch_step`` runs the step with them.

``decode_logits`` (the model runner's decode-only steps) goes on in the same call from
the token ids' embedding rows through the LM head to the logits, and to each row's greedy
token where that is all a row asks for; ``decoder_step`` stops at the final hidden states
(the model's forward).

The model hands it a plan of arrays and weight addresses (``DecoderStepPlan``,
built by ``models/cpu_step.py`` from stacks of exactly the Llama shape: Llama, Mistral,
Qwen2) with float32 activations and weights in panels for one-row inputs (float32, or
int8 with per-row scales, as ``gemv``), and no tensor parallelism. Anything else keeps
the torch path, which is also the reference this is tested against
(``tests/test_cpu_decoder_step.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numba
import numpy as np
import torch
from numba import prange, types
from numba.extending import intrinsic, overload

from rvllm.kernels.cpu import numba_cache  # noqa: F401 - stamps the cache
from rvllm.kernels.cpu.decode_attention import (
    _attend_part,
    _merge,
    _paged_decode,
    num_splits_for,
    split_range,
)
from rvllm.kernels.cpu.gemv import (
    PANEL,
    SUMS,
    Panels,
    _matvec,
    _panels_into,
    _share,
    _streams,
    embedding_rows,
    embedding_table,
    panel_shape,
)
from rvllm.kernels.cpu.numerics import _prefetch, kv_array
from rvllm.kernels.cpu.packed import (
    dequant_panel,
    is_packed,
    panel_address,
    panel_stride16,
    rounded_x,
)
from rvllm.kernels.cpu.step_parts import (
    _gate_up_share,
    _gate_up_silu,
    _head_greedy,
    _head_share,
    _merge_greedy,
    _rms_norm,
    _rope_and_cache,
)
from rvllm.kernels.cpu.sync import claim, done, finish, phases, publish, spin, wait
from rvllm.kernels.cpu.threads import match_torch_threads


@intrinsic
def _pointer_like(typingctx, address, like):
    """A pointer to ``like``'s element type at an integer address: the layers' weights
    stay where each linear layer keeps them, and the step reaches them through a
    per-layer array of addresses (``_weight``) instead of a stacked copy."""
    pointer = types.CPointer(like.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(pointer))
    return pointer(types.int64, like), codegen


@numba.njit(cache=True, inline="always")
def _weight(addresses, layer, like, rows, cols):
    """The panels of a [rows, cols] weight (``gemv``) at ``addresses[layer]`` (packed
    panels: as long as their header says; layers may differ in format)."""
    if is_packed(like):
        cols = panel_stride16(addresses[layer])
    return numba.carray(_pointer_like(addresses[layer], like),
                        ((rows + PANEL - 1) // PANEL, cols, PANEL))


# Decode steps of at most this many sequences run here (float32 weights, int8 weights);
# larger ones are arithmetic-bound, where the GEMMs over the panels win.
MAX_ROWS, MAX_ROWS_INT8 = 8, 4
# Steps of packed weights in the one parallel region, up to this many rows.
REGION_ROWS_PACKED = 8


# A layer's phases in the step's parallel region (``sync``): the QKV projection (its
# tail: RoPE and the cache write), attention (tail: the splits' merge), the output
# projection (tail: the residual add and the second norm), gate/up, down (tail: the
# residual add and the next layer's norm); after the last layer, the LM head.
PHASES = 5
LINE = 64  # bytes of a cache line
FETCH_BYTES = 64 * 1024
# A GEMV's last 1 / TAIL of panels goes in items of about 1 / (TAIL * SMALL * threads) of
# them, and at least PAIR panels (``_item_panels``): one-panel items were read as one
# stream, slower than two side by side (``gemv._panels_into``).
TAIL, SMALL, PAIR = 8, 4, 2


@numba.njit(fastmath=True, error_model="numpy", cache=True)
def _add_rows(hidden, delta):
    """hidden += delta, [B, H]: a loop (an array expression in a prange body would be a
    parallel loop of its own for numba to serialise)."""
    for b in range(hidden.shape[0]):
        for i in range(hidden.shape[1]):
            hidden[b, i] += delta[b, i]


@numba.njit(cache=True, inline="always")
def _tail_panels(n, parts):
    """How many of a GEMV's n panels are left out of the threads' first shares, and the
    panels of each item they are cut into."""
    tail = n // TAIL if parts > 1 else 0
    return tail, max(PAIR, tail // (SMALL * parts))


@numba.njit(cache=True, inline="always")
def _items(n, parts):
    """How many work items a GEMV of n panels is cut into on ``parts`` threads
    (``_item_panels``)."""
    tail, size = _tail_panels(n, parts)
    return parts + -(-tail // size)


@numba.njit(cache=True, inline="always")
def _item_panels(n, item, parts):
    """Panels [lo, hi) of work item ``item`` of a GEMV of n panels: the first ``parts``
    items are near-equal shares of all but its last n // ``TAIL`` panels, one each for
    the threads to claim before the phase begins; the rest are short runs of those last
    panels, for whichever thread is free first. Two equal shares ended up to 6% apart
    (one vCPU slower than the other through a whole step), and the early thread waited."""
    tail, size = _tail_panels(n, parts)
    if item < parts:
        return _share(n - tail, item, parts)
    lo = n - tail + (item - parts) * size
    return lo, min(lo + size, n)


@numba.njit(fastmath=True, error_model="numpy", cache=True)
def _linear_items(counters, phase, item, x, w, scale, bias, out, parts, sums):
    """The items of out = x W^T (``gemv._panels_into``) this thread claims of
    ``phase``'s (``_item_panels``), from ``item`` (claimed before); whether it ended the
    last one (it then owes the tail)."""
    items, last = _items(w.shape[0], parts), False
    xq = rounded_x(x, w) if item < items else np.empty((0, 0), np.uint8)
    while item < items:
        lo, hi = _item_panels(w.shape[0], item, parts)
        _panels_into(x, w, scale, bias, out, lo, hi, sums, xq)
        last = finish(counters, phase, items)
        item = claim(counters, phase)
    return last


@numba.njit(fastmath=True, error_model="numpy", cache=True)
def _gate_up_items(counters, phase, item, x, w, scale, bias, out, parts, sums):
    """``_linear_items`` for the fused gate/up (``step_parts._gate_up_share``: the
    items are of the gate's panels, each with the same panels of up)."""
    n = out.shape[1] // PANEL
    items, last = _items(n, parts), False
    xq = rounded_x(x, w) if item < items else np.empty((0, 0), np.uint8)
    while item < items:
        lo, hi = _item_panels(n, item, parts)
        _gate_up_share(x, w, scale, bias, out, lo, hi, sums, xq)
        last = finish(counters, phase, items)
        item = claim(counters, phase)
    return last


@numba.njit(fastmath=True, error_model="numpy", cache=True)
def _head_items(counters, phase, item, x, w, scale, logits, tops, firsts, totals, parts, sums):
    """``_linear_items`` for the LM head (``step_parts._head_share``; tops, firsts
    and totals have a row for each item)."""
    items, last = _items(w.shape[0], parts), False
    xq = rounded_x(x, w) if item < items else np.empty((0, 0), np.uint8)
    while item < items:
        lo, hi = _item_panels(w.shape[0], item, parts)
        _head_share(x, w, scale, logits, tops, firsts, totals, item, lo, hi, sums, xq)
        last = finish(counters, phase, items)
        item = claim(counters, phase)
    return last


@numba.njit(fastmath=True, error_model="numpy", cache=True)
def _attention_items(counters, phase, item, q, keys, values, tables, lens, window,
                     num_splits, part_max, part_sum, part_out, out):
    """The work items (a sequence, or a split of its context) of one layer's decode
    attention (``decode_attention._attend_part``) this thread claims, from ``item``
    (claimed before); whether it ended the last one."""
    items = q.shape[0] * num_splits
    last = False
    while item < items:
        _attend_part(q, keys, values, tables, lens, np.float32(1.0), window,
                     np.float32(0.0), num_splits, part_max, part_sum, part_out, item, out)
        last = finish(counters, phase, items)
        item = claim(counters, phase)
    return last


@numba.njit(cache=True, inline="always")
def _span(w, shares):
    """How many bytes of each run of a share to ask for while waiting: up to
    ``FETCH_BYTES``, within the run (a share of ``shares`` cut into four runs)."""
    return min(FETCH_BYTES, w.shape[0] // shares // 4 * w.shape[1] * PANEL * w.itemsize)


@numba.njit(cache=True, inline="always")
def _panel_address(w, p):
    if is_packed(w):
        return panel_address(w, p)
    return w.ctypes.data + p * w.shape[1] * PANEL * w.itemsize


@numba.njit(cache=True, inline="always")
def _linear_starts(w, item, parts, batch):
    """Where the runs of ``item``'s share of a GEMV over the panels w begin, in the order
    ``gemv._panels_into`` reads them (addresses; 0: no run, or not a first share)."""
    if item >= parts or w.shape[0] == 0:
        return 0, 0, 0, 0
    lo, hi = _item_panels(w.shape[0], item, parts)
    streams = _streams(batch)
    run = (hi - lo) // streams
    if run == 0:
        return _panel_address(w, lo), 0, 0, 0
    if streams == 2:
        return _panel_address(w, lo), _panel_address(w, lo + run), 0, 0
    return (_panel_address(w, lo), _panel_address(w, lo + run),
            _panel_address(w, lo + 2 * run), _panel_address(w, lo + 3 * run))


@numba.njit(cache=True, inline="always")
def _gate_up_starts(w, item, parts, batch):
    """``_linear_starts`` for a share of the fused gate/up
    (``step_parts._gate_up_share``: gate and up panels side by side)."""
    if item >= parts:
        return 0, 0, 0, 0
    gate_panels = w.shape[0] // 2
    lo, hi = _item_panels(gate_panels, item, parts)
    run = (hi - lo) // (_streams(batch) // 2)
    if run == 0 or _streams(batch) == 2:
        return _panel_address(w, lo), _panel_address(w, lo + gate_panels), 0, 0
    return (_panel_address(w, lo), _panel_address(w, lo + gate_panels),
            _panel_address(w, lo + run), _panel_address(w, lo + run + gate_panels))


@numba.njit(cache=True, inline="always")
def _wait_fetching(counters, phase, starts, span, offset):
    """Wait for ``phase`` while asking the memory for the first ``span`` bytes of each
    run in ``starts`` (the share this thread claimed of the next GEMV), a line of each
    in turn from ``offset``: a thread that finished its share early would otherwise
    leave its half of the memory's bandwidth idle. Returns how far it got."""
    while not done(counters, phase):
        if offset < span:
            for start in starts:
                if start != 0:
                    _prefetch(start + offset)
            offset += LINE
        else:
            spin()
    return offset


@numba.njit(cache=True, inline="always")
def _wait_fetching_split(counters, phase, keys, values, table, lens, window, num_splits,
                         item, starts, span):
    """``_wait_fetching`` for the phase before attention, asking first for the key and
    value blocks of the split ``item`` of one sequence's context (claimed before) that
    the thread is to attend over: they were written a step ago, and the step's weights
    have streamed through the caches since."""
    block_size = keys.shape[1]
    if item < num_splits:
        lo, hi, t_lo, t_hi = split_range(lens[0], window, block_size, num_splits, item)
        block_bytes = block_size * keys.shape[2] * keys.shape[3] * keys.itemsize
        total = 2 * max(hi - lo, 0) * block_bytes  # the keys, then the values
        offset = 0
        while offset < total and not done(counters, phase):
            b = offset // block_bytes
            cache = keys if b < hi - lo else values
            _prefetch(cache.ctypes.data + table[lo + b % (hi - lo)] * block_bytes
                      + offset % block_bytes)
            offset += LINE
    return _wait_fetching(counters, phase, starts, span, 0)


@numba.njit(cache=True, inline="always")
def _buffers(rows, size, qkv_rows, num_heads, head_dim, inter):
    """A step's activations: the normed rows, a layer's output delta, the QKV projection,
    the scaled queries, attention's output and SiLU(gate) * up."""
    return (np.empty((rows, size), np.float32), np.empty((rows, size), np.float32),
            np.empty((rows, qkv_rows), np.float32),
            np.empty((rows, num_heads, head_dim), np.float32),
            np.empty((rows, num_heads, head_dim), np.float32),
            np.empty((rows, inter), np.float32))


# numpy's error model: nothing in the region may raise (a division by zero on NaN
# activations did), or the thread that raised leaves it and the other waits forever.
@numba.njit(parallel=True, fastmath=True, error_model="numpy", cache=True)
def _one_region(hidden, norms1, qkv_w, qkv_s, qkv_b, o_w, o_s, o_b, norms2,
                gu_w, gu_s, gu_b, down_w, down_s, down_b, like, inter, key_cache,
                value_cache, windows, tables, positions, slots, cos_table, sin_table,
                num_heads, num_kv_heads, head_dim, scale, eps, final_norm, out, head_w,
                head_s, logits, greedy_ids, greedy_logprobs, parts):
    """``_decoder_step`` (its arguments) in one parallel region of ``parts`` iterations,
    the work of each phase claimed by whichever thread is free (``sync``)."""
    rows, size = hidden.shape
    layers = norms1.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv_rows = q_size + 2 * kv_size
    normed, delta, qkv, q, attn, act = _buffers(rows, size, qkv_rows, num_heads, head_dim,
                                                inter)
    # One split of the context a thread: each claims its own before the QKV projection
    # ends and asks for its blocks meanwhile (``_wait_fetching_split``). Traced at a
    # context of 32-180 tokens, attention took 10.8 us a layer so, 13.1 us as four splits
    # on two threads (two runs, the machine's speed not the same in both).
    lens, num_splits = positions + 1, parts
    part_max = np.empty((rows, num_splits, num_heads), np.float32)
    part_sum = np.empty((rows, num_splits, num_heads), np.float32)
    part_out = np.empty((rows if num_splits > 1 else 0, num_splits, num_heads, head_dim),
                        np.float32)
    # Each GEMV: a first share per thread, then short items (``_item_panels``); equal
    # fine shares (more, shorter streams) were slower.
    items = parts
    shares = _items(head_w.shape[0], parts) if greedy_ids.shape[0] > 0 else 0
    tops = np.empty((shares, rows), np.float32)
    totals = np.empty((shares, rows), np.float32)
    firsts = np.empty((shares, rows), np.int64)
    counters = phases(layers * PHASES + 1)
    _rms_norm(hidden, norms1[0], eps, normed)
    for _ in prange(parts):  # the threads: which one does what is claimed
        sums = np.empty((SUMS, PANEL), np.float32)
        item = claim(counters, 0)
        for layer in range(layers):
            keys, values = key_cache[layer], value_cache[layer]
            phase = layer * PHASES
            w_o = _weight(o_w, layer, like, size, q_size)
            w_gu = _weight(gu_w, layer, like, 2 * inter, size)
            w_down = _weight(down_w, layer, like, size, inter)
            # Each thread claims its share of the next GEMV before it waits for this
            # phase, and asks for its first panels meanwhile (``_wait_fetching``).
            last = _linear_items(counters, phase, item, normed,
                                 _weight(qkv_w, layer, like, qkv_rows, size),
                                 qkv_s[layer], qkv_b[layer], qkv, items, sums)
            split = claim(counters, phase + 1)
            item = claim(counters, phase + 2)
            starts, span = _linear_starts(w_o, item, items, rows), _span(w_o, items)
            if last:
                _rope_and_cache(qkv, q, scale, keys, values, positions, slots, cos_table,
                                sin_table)
                publish(counters, phase)
            fetched = _wait_fetching_split(counters, phase, keys, values, tables[0], lens,
                                           windows[layer], num_splits, split, starts, span)
            if _attention_items(counters, phase + 1, split, q, keys, values, tables, lens,
                                windows[layer], num_splits, part_max, part_sum, part_out,
                                attn):
                if num_splits > 1:
                    for seq in range(rows):
                        _merge(part_max, part_sum, part_out, seq, attn)
                publish(counters, phase + 1)
            _wait_fetching(counters, phase + 1, starts, span, fetched)
            last = _linear_items(counters, phase + 2, item, attn.reshape((rows, q_size)),
                                 w_o, o_s[layer], o_b[layer], delta, items, sums)
            item = claim(counters, phase + 3)
            if last:
                _add_rows(hidden, delta)
                _rms_norm(hidden, norms2[layer], eps, normed)
                publish(counters, phase + 2)
            _wait_fetching(counters, phase + 2, _gate_up_starts(w_gu, item, items, rows),
                           _span(w_gu, 2 * items), 0)
            last = _gate_up_items(counters, phase + 3, item, normed, w_gu, gu_s[layer],
                                  gu_b[layer], act, items, sums)
            item = claim(counters, phase + 4)
            if last:
                publish(counters, phase + 3)
            _wait_fetching(counters, phase + 3, _linear_starts(w_down, item, items, rows),
                           _span(w_down, items), 0)
            last = _linear_items(counters, phase + 4, item, act, w_down, down_s[layer],
                                 down_b[layer], delta, items, sums)
            item = claim(counters, phase + PHASES)  # the next layer's QKV, or the head
            if layer + 1 < layers:
                w_next = _weight(qkv_w, layer + 1, like, qkv_rows, size)
            else:
                w_next = head_w
            if last:
                _add_rows(hidden, delta)
                if layer + 1 < layers:
                    _rms_norm(hidden, norms1[layer + 1], eps, normed)
                else:
                    _rms_norm(hidden, final_norm, eps, out)
                publish(counters, phase + 4)
            _wait_fetching(counters, phase + 4, _linear_starts(w_next, item, items, rows),
                           _span(w_next, items), 0)
        if head_w.shape[0] > 0:
            phase = layers * PHASES
            if _head_items(counters, phase, item, out, head_w, head_s, logits, tops,
                           firsts, totals, items, sums):
                if shares > 0:
                    _merge_greedy(tops, firsts, totals, greedy_ids, greedy_logprobs)
                publish(counters, phase)
            wait(counters, phase)


@numba.njit(fastmath=True, cache=True)
def _by_op(hidden, norms1, qkv_w, qkv_s, qkv_b, o_w, o_s, o_b, norms2, gu_w, gu_s, gu_b,
           down_w, down_s, down_b, like, inter, key_cache, value_cache, windows, tables,
           positions, slots, cos_table, sin_table, num_heads, num_kv_heads, head_dim,
           scale, eps, final_norm, out, head_w, head_s, logits, greedy_ids,
           greedy_logprobs, parts):
    """``_decoder_step`` as a parallel loop a projection and an attention, the rest on
    the calling thread between them (``_one_region`` was 3-13% slower at 4 and 8 rows
    on a 2-core Zen 3, alternated in one process: bound by arithmetic, its threads
    waited longer at the phases' ends)."""
    rows, size = hidden.shape
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv_rows = q_size + 2 * kv_size
    normed, delta, qkv, q, attn, act = _buffers(rows, size, qkv_rows, num_heads, head_dim,
                                                inter)
    lens, num_splits = positions + 1, num_splits_for(rows, parts)
    for layer in range(norms1.shape[0]):
        if layer > 0:
            _add_rows(hidden, delta)
        _rms_norm(hidden, norms1[layer], eps, normed)
        _matvec(normed, _weight(qkv_w, layer, like, qkv_rows, size), qkv_s[layer],
                qkv_b[layer], qkv, parts)
        _rope_and_cache(qkv, q, scale, key_cache[layer], value_cache[layer], positions,
                        slots, cos_table, sin_table)
        _paged_decode(q, key_cache[layer], value_cache[layer], tables, lens,
                      np.float32(1.0), windows[layer], np.float32(0.0), num_splits, parts,
                      attn)
        _matvec(attn.reshape((rows, q_size)), _weight(o_w, layer, like, size, q_size),
                o_s[layer], o_b[layer], delta, parts)
        _add_rows(hidden, delta)
        _rms_norm(hidden, norms2[layer], eps, normed)
        _gate_up_silu(normed, _weight(gu_w, layer, like, 2 * inter, size), gu_s[layer],
                      gu_b[layer], act, parts)
        _matvec(act, _weight(down_w, layer, like, size, inter), down_s[layer],
                down_b[layer], delta, parts)
    _add_rows(hidden, delta)
    _rms_norm(hidden, final_norm, eps, out)
    if head_w.shape[0] == 0:
        return
    if greedy_ids.shape[0] > 0:
        _head_greedy(out, head_w, head_s, logits, greedy_ids, greedy_logprobs, parts)
    else:
        _matvec(out, head_w, head_s, np.empty(0, np.float32), logits, parts)


def _decoder_step(hidden, norms1, qkv_w, qkv_s, qkv_b, o_w, o_s, o_b, norms2,
                  gu_w, gu_s, gu_b, down_w, down_s, down_b, like, inter, key_cache,
                  value_cache, windows, tables, positions, slots, cos_table, sin_table,
                  num_heads, num_kv_heads, head_dim, scale, eps, final_norm, out, head_w,
                  head_s, logits, greedy_ids, greedy_logprobs, parts):
    """One new token of each of B sequences through every layer. hidden [B, H]: the
    tokens' embeddings, then the residual stream as the layers run. ``*_w``: each
    layer's weight panels of that projection, by address (int64 [L]; element type
    ``like``'s); ``*_s``, ``*_b``: per-row scales (int8) and biases stacked [L, N], or
    [L, 0] for none; norms [L, H]; key_cache / value_cache [L, blocks, block_size, Hk,
    D], float32 or bfloat16 bits (``numerics.kv_array``); tables [B, W] each row's cache
    blocks; slots [B] where its K/V go (-1: nowhere); parts: numba's thread count (see
    ``gemv._matvec``). Writes the final norm of the last residual to ``out`` [B,
    H]; with LM head panels ``head_w`` (not empty; int8 scales head_s) its logits [B, V]
    into ``logits``, and with greedy_ids / greedy_logprobs of length B (not 0) each
    row's greedy token and its logprob (``step_parts._merge_greedy``). One row:
    ``_one_region``; more: ``_by_op``. Plain Python: numba optimizes a compiled caller
    again with all its callees' code linked in, 15-18 s a form for this dispatch alone
    (``_step_to_logits`` makes it itself)."""
    args = (hidden, norms1, qkv_w, qkv_s, qkv_b, o_w, o_s, o_b, norms2, gu_w, gu_s, gu_b,
            down_w, down_s, down_b, like, inter, key_cache, value_cache, windows, tables,
            positions, slots, cos_table, sin_table, num_heads, num_kv_heads, head_dim,
            scale, eps, final_norm, out, head_w, head_s, logits, greedy_ids,
            greedy_logprobs, parts)
    if hidden.shape[0] == 1:
        _one_region(*args)
    else:
        _by_op(*args)


def _embedding_rows_into(embedding, token_ids, hidden):  # noqa: ANN001, ANN202
    """hidden[b] = the embedding table's row token_ids[b] (numba-only)."""
    raise NotImplementedError("numba-only")


@overload(_embedding_rows_into)
def _embedding_rows_into_overload(embedding, token_ids, hidden):  # noqa: ANN001, ANN202
    if embedding.dtype == types.uint8:
        def packed(embedding, token_ids, hidden):  # noqa: ANN001, ANN202
            # Packed panels (``packed``): a row's panel widened, its lane kept.
            scratch = np.empty((1, hidden.shape[1], PANEL), np.float32)
            for b in range(token_ids.shape[0]):
                dequant_panel(embedding, token_ids[b] // PANEL, scratch)
                hidden[b] = scratch[0, :, token_ids[b] % PANEL]
        return packed

    def table(embedding, token_ids, hidden):  # noqa: ANN001, ANN202
        per = embedding.shape[2]
        for b in range(token_ids.shape[0]):
            hidden[b] = embedding[token_ids[b] // per, :, token_ids[b] % per]
    return table


@numba.njit(fastmath=True, cache=True)
def _step_to_logits(embedding, token_ids, norms1, qkv_w, qkv_s, qkv_b, o_w, o_s, o_b,
                    norms2, gu_w, gu_s, gu_b, down_w, down_s, down_b, like, inter,
                    key_cache, value_cache, windows, tables, positions, slots, cos_table,
                    sin_table, num_heads, num_kv_heads, head_dim, scale, eps, final_norm,
                    head_w, head_s, logits, greedy_ids, greedy_logprobs, parts, region_rows):
    """``_decoder_step`` from the token ids' rows of the embedding (a table [V / P, H, P],
    ``gemv.embedding_table``) through the LM head (panels head_w, int8 scales
    head_s); in one parallel region up to ``region_rows`` rows."""
    rows, size = token_ids.shape[0], final_norm.shape[0]
    hidden = np.empty((rows, size), np.float32)
    _embedding_rows_into(embedding, token_ids, hidden)
    args = (hidden, norms1, qkv_w, qkv_s, qkv_b, o_w, o_s, o_b, norms2, gu_w, gu_s,
            gu_b, down_w, down_s, down_b, like, inter, key_cache, value_cache,
            windows, tables, positions, slots, cos_table, sin_table, num_heads,
            num_kv_heads, head_dim, scale, eps, final_norm,
            np.empty((rows, size), np.float32), head_w, head_s, logits, greedy_ids,
            greedy_logprobs, parts)
    if rows <= max(1, region_rows):
        _one_region(*args)
    else:
        _by_op(*args)


def stack_linears(copies: list[Panels], biases: list[torch.Tensor | None]) -> dict | None:
    """One projection of every layer, from its panels (``gemv.Panels``) and biases: the
    panels' addresses (``w``, int64 [L]), the per-row scales (int8) and biases stacked
    [L, N], or [L, 0] for none (``s``, ``b``), the panels themselves (``panels``, kept
    alive with the plan) and their element type as an empty array (``like``). None when
    the layers differ in format or shape."""
    if len({(c.weight.dtype, c.weight.shape[0], c.cols, c.rows, c.scale.shape)
            for c in copies}) != 1:
        return None  # (packed layers may differ in format: each panel has its header)
    if not all(c.weight.flags.c_contiguous for c in copies):
        return None
    addresses = np.array([c.weight.ctypes.data for c in copies], dtype=np.int64)
    rows = copies[0].rows
    scale = (np.stack([c.scale for c in copies]) if copies[0].scale.shape[0] > 0
             else np.empty((len(copies), 0), np.float32))
    if any(b is None for b in biases):
        bias = np.empty((len(copies), 0), np.float32)
    else:
        bias = torch.stack([b.detach().float() for b in biases]).numpy()
    assert bias.shape[1] in (0, rows) and scale.shape[1] in (0, rows)
    return {"w": addresses, "s": scale, "b": bias, "panels": copies,
            "like": np.empty(0, copies[0].weight.dtype)}


@dataclass(slots=True)
class DecoderStepPlan:
    """Everything ``_decoder_step`` reads for one model but the KV caches, gathered once
    by the model (``models.cpu_step.build_plan``): each projection's panels by address
    (``*_w``; the panels stay with their linear layers, and ``weights`` keeps them alive
    too), its int8 scales and biases (``*_s``, ``*_b``), the norms stacked over the
    layers, the rotary tables and the embedding table."""

    qkv_w: np.ndarray
    qkv_s: np.ndarray
    qkv_b: np.ndarray
    o_w: np.ndarray
    o_s: np.ndarray
    o_b: np.ndarray
    gu_w: np.ndarray
    gu_s: np.ndarray
    gu_b: np.ndarray
    down_w: np.ndarray
    down_s: np.ndarray
    down_b: np.ndarray
    weights: list[list[Panels]]  # per projection, every layer's panels
    like: np.ndarray  # an empty array of the weights' element type
    norms1: np.ndarray  # [L, H]
    norms2: np.ndarray  # [L, H]
    windows: np.ndarray  # int64 [L]: each layer's sliding window, 0 for none
    cos: np.ndarray
    sin: np.ndarray
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: np.float32
    eps: np.float32
    final_norm: np.ndarray  # [H]
    embedding: torch.Tensor  # ``gemv.embedding_table``
    embedding_array: np.ndarray  # the same table as the compiled calls take it
    inter: int
    max_rows: int


def make_plan(projections: dict[str, dict], norms1: np.ndarray, norms2: np.ndarray,
              windows: np.ndarray, cos: np.ndarray, sin: np.ndarray, num_heads: int,
              num_kv_heads: int, head_dim: int, scale: float, eps: float,
              final_norm: np.ndarray, embedding_weight: torch.Tensor
              ) -> DecoderStepPlan | None:
    """The plan from each projection's ``stack_linears`` (keys ``qkv``, ``o``, ``gu``,
    ``down``) and the stack's other arrays, or None when the kernel cannot compute it:
    the projections differ in weight format, their shapes are not exactly the ones
    these head counts and sizes make (the kernel reads each weight by address), or the
    intermediate size is not whole panels (the fused gate/up takes whole panels of
    each)."""
    if len({p["like"].dtype for p in projections.values()}) != 1:
        return None  # one weight format for the whole stack
    hidden = final_norm.shape[0]
    inter = projections["gu"]["panels"][0].rows // 2
    if inter % PANEL:
        return None
    q_size = num_heads * head_dim
    expected = {"qkv": (q_size + 2 * num_kv_heads * head_dim, hidden), "o": (hidden, q_size),
                "gu": (2 * inter, hidden), "down": (hidden, inter)}
    for name, shape in expected.items():
        first = projections[name]["panels"][0]
        if (first.rows, first.cols) != shape:
            return None
    like = projections["qkv"]["like"]
    embedding = embedding_table(embedding_weight)
    fields = {f"{name}_{part}": projections[name][part]
              for name in expected for part in ("w", "s", "b")}
    return DecoderStepPlan(
        **fields, weights=[projections[name]["panels"] for name in expected], like=like,
        norms1=norms1, norms2=norms2, windows=windows, cos=cos, sin=sin,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        scale=np.float32(scale), eps=np.float32(eps), final_norm=final_norm,
        embedding=embedding, embedding_array=embedding.numpy(), inter=inter,
        max_rows=MAX_ROWS_INT8 if like.dtype == np.int8 else MAX_ROWS)


def stacked_caches(layer_caches: list[tuple[torch.Tensor, torch.Tensor]]
                   ) -> tuple[np.ndarray, np.ndarray] | None:
    """[L, blocks, block_size, Hk, D] keys and values as the kernel reads them, when every
    layer's (key, value) cache is its slice of one allocation of each
    (``ModelRunner.allocate_kv_cache``); else None."""
    stacked = []
    for which in (0, 1):
        base = layer_caches[0][which]._base
        if base is None or base.dim() != 5 or base.shape[0] != len(layer_caches):
            return None
        if any(cache[which].data_ptr() != base[i].data_ptr()
               for i, cache in enumerate(layer_caches)):
            return None
        stacked.append(kv_array(base))
    return stacked[0], stacked[1]


# Where ``_layer_args`` puts the weights' element type (``like``) and the cache slots.
LIKE_ARG, SLOTS_ARG = 14, 21


def _layer_args(plan: DecoderStepPlan, caches: tuple[np.ndarray, np.ndarray],
                block_tables: np.ndarray, positions: np.ndarray, slots: np.ndarray | int
                ) -> tuple:
    """``_decoder_step``'s arguments from ``norms1`` to ``final_norm``, as its callers
    pass them (``decode_steps`` passes a block size in the slots' place)."""
    return (plan.norms1, plan.qkv_w, plan.qkv_s, plan.qkv_b, plan.o_w, plan.o_s, plan.o_b,
            plan.norms2, plan.gu_w, plan.gu_s, plan.gu_b, plan.down_w, plan.down_s,
            plan.down_b, plan.like, plan.inter, *caches, plan.windows, block_tables,
            positions, slots, plan.cos, plan.sin, plan.num_heads, plan.num_kv_heads,
            plan.head_dim, plan.scale, plan.eps, plan.final_norm)


def decoder_step(plan: DecoderStepPlan, caches: tuple[np.ndarray, np.ndarray],
                 token_ids: torch.Tensor, positions: np.ndarray, slots: np.ndarray,
                 block_tables: np.ndarray) -> torch.Tensor:
    """Final hidden states [B, H] of one new token of each of B (at most
    ``plan.max_rows``) sequences: token ids [B], their positions and cache slots (int64
    [B]; slot -1: not written), each sequence's cache blocks (int64 [B, W]), and the
    stacked caches (``stacked_caches``)."""
    threads = match_torch_threads()
    hidden = embedding_rows(plan.embedding, token_ids).numpy()  # a copy: the residual stream
    out = torch.empty(hidden.shape, dtype=torch.float32)
    _decoder_step(hidden, *_layer_args(plan, caches, block_tables, positions, slots),
                  out.numpy(), *_no_head(plan.like, hidden.shape[1]), threads)
    return out


def head_fits(plan: DecoderStepPlan, head: Panels) -> bool:
    """Whether the step can go on through this LM head's panels: the stack's weight
    format and hidden size."""
    return head.cols == plan.final_norm.shape[0] and head.weight.dtype == plan.like.dtype


def _no_head(like: np.ndarray, size: int) -> tuple:
    """``_decoder_step``'s LM head arguments for a step that stops at the final hidden
    states: no panels (of the stack's weight type), no scales, logits or greedy rows."""
    empty = np.empty(0, np.float32)
    return (np.empty((0, size, PANEL), like.dtype), empty, np.empty((0, 0), np.float32),
            np.empty(0, np.int64), empty)


@dataclass(slots=True)
class DecodeLogits:
    """What ``decode_logits`` returns."""

    array: np.ndarray  # [B, V] float32 logits: a buffer the next step writes over
    greedy: tuple[list[int], list[float]] | None  # each row's argmax and its logprob

    @property
    def logits(self) -> torch.Tensor:
        """The logits as a tensor (a view of ``array``), made only where a sampler reads
        them: a greedy step has its tokens already."""
        return torch.from_numpy(self.array)


def decode_logits(plan: DecoderStepPlan, caches: tuple[np.ndarray, np.ndarray],
                  head: Panels, logits: np.ndarray, token_ids: np.ndarray,
                  positions: np.ndarray, slots: np.ndarray, block_tables: np.ndarray,
                  greedy: bool) -> DecodeLogits:
    """A decode step of B sequences (arguments as ``decoder_step``'s, token ids int64
    [B]) from the token ids through the layers and the LM head (its panels, where
    ``head_fits``) in one compiled call: the logits, written into ``logits`` [B, V],
    and with ``greedy`` each row's argmax token and its logprob, found by the threads
    that computed the logits.

    After a step has streamed the weights through the caches, every line of Python runs
    on code and data fetched from memory again: at N=1 the two calls and tensors of
    ``decoder_step`` plus ``compute_logits`` and the sampler's pass cost 0.5-0.8 ms of
    a 9 ms step (the random Llama, 2-core Zen 5); here what is left of them is the call."""
    rows = token_ids.shape[0]
    ids, logprobs = np.empty(rows if greedy else 0, np.int64), np.empty(rows, np.float32)
    threads = match_torch_threads()
    region = REGION_ROWS_PACKED if plan.like.dtype == np.uint8 else 1
    _step_to_logits(plan.embedding_array, token_ids,
                    *_layer_args(plan, caches, block_tables, positions, slots), head.weight,
                    head.scale, logits, ids, logprobs, threads, region)
    return DecodeLogits(logits, (ids.tolist(), logprobs.tolist()) if greedy else None)


def weight_types(int8: bool, float32: bool = True, packed: bool = False) -> tuple[type, ...]:
    """The weights' element types a warm-up covers: float32 unless not ``float32``, int8
    when ``int8``, packed GGUF blocks (uint8) when ``packed``."""
    return (np.float32,) * float32 + (np.int8,) * int8 + (np.uint8,) * packed


def _toy_weight(rows: int, cols: int, dtype: type) -> np.ndarray:
    """Zero panels of a [rows, cols] weight of ``dtype`` (uint8: packed Q8_0 blocks)."""
    if dtype is not np.uint8:
        return np.zeros(panel_shape(rows, cols), dtype)
    from rvllm.kernels.cpu.packed import Q8_0, TYPE_BYTES, QuantizedRows, pack_rows

    data = np.zeros((rows, cols // 32 * TYPE_BYTES[Q8_0]), np.uint8)
    return pack_rows([QuantizedRows(Q8_0, data, cols)], rows).weight


def warm_up_args(kv_dtype: torch.dtype = torch.float32, int8: bool = True,
                 float32: bool = True, packed: bool = False
                 ) -> Iterator[tuple[tuple, np.ndarray, np.ndarray]]:
    """For each of ``weight_types``: ``_layer_args`` of a one-layer toy stack with a
    cache of ``kv_dtype`` and one row, and a toy LM head's panels and scales. The toy
    weights live while the caller iterates."""
    heads, kv_heads, dim, hidden, inter = 2, 1, 16, 32, 32
    for dtype in weight_types(int8, float32, packed):
        kept = []  # the step reads the toy weights by address

        def linear(rows: int, cols: int, dtype: type = dtype, kept: list = kept) -> tuple:
            weight = _toy_weight(rows, cols, dtype)
            kept.append(weight)
            scale = np.ones((1, rows if dtype is np.int8 else 0), np.float32)
            return (np.array([weight.ctypes.data], np.int64), scale,
                    np.empty((1, 0), np.float32))

        ones = np.ones((1, hidden), np.float32)
        cache = kv_array(torch.zeros((1, 1, 4, kv_heads, dim), dtype=kv_dtype))
        rope = np.ones((4, dim), np.float32)
        zeros = np.zeros(1, np.int64)
        layers = (ones, *linear((heads + 2 * kv_heads) * dim, hidden),
                  *linear(hidden, heads * dim), ones, *linear(2 * inter, hidden),
                  *linear(hidden, inter), np.empty(0, dtype), inter, cache, cache,
                  zeros, np.zeros((1, 1), np.int64), zeros, zeros, rope, rope, heads,
                  kv_heads, dim, np.float32(1.0), np.float32(1e-6),
                  np.ones(hidden, np.float32))
        yield (layers, _toy_weight(20, hidden, dtype),
               np.ones(20 if dtype is np.int8 else 0, np.float32))


def warm_up(kv_dtype: torch.dtype = torch.float32, int8: bool = True,
            float32: bool = True, packed: bool = False) -> None:
    """Compile (or load from numba's cache) the step for each of ``weight_types`` on a
    one-layer toy stack with a cache of ``kv_dtype``, so a model's first decode step does
    not pay for it."""
    for layers, head, scale in warm_up_args(kv_dtype, int8, float32, packed):
        hidden = layers[0].shape[1]
        like = layers[LIKE_ARG]
        _decoder_step(np.zeros((1, hidden), np.float32), *layers,
                      np.empty((1, hidden), np.float32), *_no_head(like, hidden),
                      numba.get_num_threads())
        embedding = head if like.dtype == np.uint8 else np.zeros((20, hidden, 1), np.float32)
        _step_to_logits(embedding, np.zeros(1, np.int64),
                        *layers, head, scale, np.empty((1, 20), np.float32),
                        np.empty(1, np.int64), np.empty(1, np.float32),
                        numba.get_num_threads(), 1)
