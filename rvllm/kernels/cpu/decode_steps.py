"""Several greedy decode steps of a few sequences in one numba call (``--num-scheduler-steps``).

A one-sequence step on a 2-core CPU spends 0.5 ms outside its compiled call: the engine's
Python (scheduling, appending the token, the stop checks, the request's output) runs on
code and data that the step's 538 MB of weights have just pushed out of the caches. When
every row of the step is plain greedy, the next step's input is the argmax the call has
already found, so the call can go on: ``decode_greedy_steps`` feeds each step's tokens to
the next, with the positions and cache slots that follow from the block tables, and the
engine takes the tokens of all the steps at once. It stops early once every row has
produced one of its stop tokens; a row that stopped earlier than the others goes on
computing with the rest, and the engine drops its extra tokens (so too after a stop
string, which only the detokenized text shows).

The scheduler must have given each sequence cache blocks for every step's position first
(``Scheduler`` with ``num_scheduler_steps``). Each step is ``_step_to_logits``, so each is
the single step that is tested against the torch path.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from rvllm.kernels.cpu.decoder_step import (
    LIKE_ARG,
    SLOTS_ARG,
    DecoderStepPlan,
    _layer_args,
    _step_to_logits,
    warm_up_args,
)
from rvllm.kernels.cpu.gemv import Panels
from rvllm.kernels.cpu.threads import match_torch_threads


@numba.njit(fastmath=True, cache=True)
def _greedy_steps(embedding, token_ids, norms1, qkv_w, qkv_s, qkv_b, o_w, o_s, o_b,
                  norms2, gu_w, gu_s, gu_b, down_w, down_s, down_b, like, inter,
                  key_cache, value_cache, windows, tables, positions, block_size,
                  cos_table, sin_table, num_heads, num_kv_heads, head_dim, scale, eps,
                  final_norm, head_w, head_s, logits, stops, step_ids, step_logprobs,
                  parts):
    """Up to ``step_ids.shape[0]`` greedy steps of B rows from token_ids [B] at
    positions [B] (``_step_to_logits``' other arguments), each step's argmax tokens and
    their logprobs into step_ids / step_logprobs [K, B]. stops [B, S]: each row's stop
    tokens, padded with -1. Returns the steps taken: fewer than K once every row has
    produced a stop token."""
    rows = token_ids.shape[0]
    ids, pos = token_ids.copy(), positions.copy()
    slots = np.empty(rows, np.int64)
    stopped = np.zeros(rows, np.bool_)
    for step in range(step_ids.shape[0]):
        for b in range(rows):
            slots[b] = tables[b, pos[b] // block_size] * block_size + pos[b] % block_size
        _step_to_logits(embedding, ids, norms1, qkv_w, qkv_s, qkv_b, o_w, o_s, o_b, norms2,
                        gu_w, gu_s, gu_b, down_w, down_s, down_b, like, inter, key_cache,
                        value_cache, windows, tables, pos, slots, cos_table, sin_table,
                        num_heads, num_kv_heads, head_dim, scale, eps, final_norm, head_w,
                        head_s, logits, step_ids[step], step_logprobs[step], parts, 1)
        every = True
        for b in range(rows):
            for s in range(stops.shape[1]):
                if stops[b, s] == step_ids[step, b]:
                    stopped[b] = True
            every = every and stopped[b]
        if every:
            return step + 1
        ids[:] = step_ids[step]
        pos += 1
    return step_ids.shape[0]


def decode_greedy_steps(plan: DecoderStepPlan, caches: tuple[np.ndarray, np.ndarray],
                        head: Panels, logits: np.ndarray, token_ids: np.ndarray,
                        positions: np.ndarray, block_tables: np.ndarray, block_size: int,
                        num_steps: int, stops: np.ndarray
                        ) -> tuple[list[list[int]], list[list[float]]]:
    """Up to ``num_steps`` greedy decode steps of B sequences from their token ids and
    positions (int64 [B]), each sequence's cache blocks covering every step's position
    (int64 [B, W]), and stop tokens (int64 [B, S], padded with -1): each step's tokens
    [steps][B] and their logprobs. The caches, LM head and logits buffer [B, V] as
    ``decoder_step.decode_logits`` takes them."""
    rows = token_ids.shape[0]
    ids = np.empty((num_steps, rows), np.int64)
    logprobs = np.empty((num_steps, rows), np.float32)
    threads = match_torch_threads()
    # In the place of the slots, the block size: each step finds its own from the tables.
    args = _layer_args(plan, caches, block_tables, positions, block_size)
    taken = _greedy_steps(plan.embedding_array, token_ids, *args, head.weight, head.scale,
                          logits, stops, ids, logprobs, threads)
    return ids[:taken].tolist(), logprobs[:taken].tolist()


def warm_up(kv_dtype: torch.dtype = torch.float32, int8: bool = True,
            float32: bool = True, packed: bool = False) -> None:
    """Compile (or load from numba's cache) ``_greedy_steps`` for the weights and caches
    ``decoder_step.warm_up`` covers, so the first multi-step call does not pay for
    it."""
    for layers, head, scale in warm_up_args(kv_dtype, int8, float32, packed):
        packed_weights = layers[LIKE_ARG].dtype == np.uint8  # a packed embedding too
        _greedy_steps(head if packed_weights else np.zeros((20, layers[0].shape[1], 1),
                                                           np.float32),
                      np.zeros(1, np.int64), *layers[:SLOTS_ARG], 4,
                      *layers[SLOTS_ARG + 1:], head, scale, np.empty((1, 20), np.float32),
                      np.full((1, 1), -1, np.int64),
                      np.empty((2, 1), np.int64), np.empty((2, 1), np.float32),
                      numba.get_num_threads())
