"""Greedy sampling: the argmax token of each row with its log-softmax logprob, in one pass.

One program per row streams the vocabulary in tiles, keeping per lane a running
max, its first index and a running sum of exp(x - max); the lanes merge at the
end. The chosen token is the max, so its logprob is -log(sum exp(x - max)) and
no second pass over the vocabulary is needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _greedy_kernel(logits_ptr, token_ptr, logprob_ptr, vocab_size, row_stride,
                   BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab_size, BLOCK):
        cols = start + lanes
        x = tl.load(logits_ptr + row * row_stride + cols, mask=cols < vocab_size,
                    other=float("-inf")).to(tl.float32)
        # Strictly greater: a lane keeps the first index of its max, as torch.argmax.
        best_idx = tl.where(x > best, cols, best_idx)
        new_best = tl.maximum(best, x)
        safe = tl.where(new_best == float("-inf"), 0.0, new_best)
        total = total * tl.exp(best - safe) + tl.exp(x - safe)
        best = new_best
    row_max = tl.max(best, axis=0)
    safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    row_total = tl.sum(total * tl.exp(best - safe_max), axis=0)
    token = tl.min(tl.where(best == row_max, best_idx, vocab_size), axis=0)
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(logprob_ptr + row, -tl.log(row_total))


def greedy_sample(logits: torch.Tensor, block: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (argmax token ids [B] int64, their log-softmax logprobs [B] float32).

    No host synchronisation, so it can run inside a CUDA graph.
    """
    batch, vocab_size = logits.shape
    assert logits.stride(1) == 1
    token_ids = torch.empty(batch, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(batch, dtype=torch.float32, device=logits.device)
    if batch:
        _greedy_kernel[(batch,)](logits, token_ids, logprobs, vocab_size, logits.stride(0),
                                 BLOCK=min(block, triton.next_power_of_2(vocab_size)),
                                 num_warps=8)
    return token_ids, logprobs


def greedy_sample_ref(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference for ``greedy_sample``."""
    logits = logits.float()
    token_ids = logits.argmax(dim=-1)
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, token_ids.unsqueeze(1)).squeeze(1)
    return token_ids, logprobs
