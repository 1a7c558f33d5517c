"""Batched device sampler: turns one step's logits into one token per sequence.

Order of operations per row (as vLLM): allowed_token_ids, logit_bias, min_tokens masking,
repetition/frequency/presence penalties, the structured-output grammar's mask; then
greedy rows take the argmax and random rows go through temperature, top-k, top-p,
min-p and an exponential-race draw. Every stage is a tensor op over the rows that
asked for it; stages nobody asked for are skipped. Logprobs are always those of the raw logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import torch

from rvllm.layers.backend import use_numba, use_triton
from rvllm.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one sequence in this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated so far for this sequence
    generator: torch.Generator | None  # per-sequence generator when params.seed is set
    # The sequence's structured-output matcher (``fill(bitmask, row)``), if it has one.
    grammar: Any = None


@dataclass(slots=True)
class SamplerOutput:
    """One step's result: a token per row, its raw logprob, and top logprobs if asked."""

    sampled_token_ids: list[int]
    sampled_logprobs: list[float]  # log-softmax of the raw logits at the chosen token
    top_logprob_ids: list[list[int]] | None  # per row, k = params.logprobs; None if no row asked
    top_logprobs: list[list[float]] | None


class Sampler(torch.nn.Module):
    """Samples one token per row of a [B, V] logits tensor, all rows at once."""

    def forward(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Process ``logits`` [B, V] under each row's params and sample a token per row."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows), V], got {tuple(logits.shape)}.")
        raw = logits.float()  # may alias the input: never modified in place
        processed = process_logits(raw, rows)
        kernel = use_triton() or (use_numba() and raw.device.type == "cpu")
        if (kernel and processed is raw and all(r.params.is_greedy for r in rows)
                and all(r.params.logprobs is None for r in rows)):
            if use_triton():
                # One pass over the logits for the argmax and its logprob.
                from rvllm.kernels.triton.greedy import greedy_sample

                token_ids, logprobs = greedy_sample(raw)
                return SamplerOutput(token_ids.tolist(), logprobs.tolist(), None, None)
            from rvllm.kernels.cpu.greedy import greedy_sample as cpu_greedy_sample

            return SamplerOutput(*cpu_greedy_sample(raw), None, None)
        token_ids = _sample(processed, rows)
        return _make_output(raw, token_ids, rows)


def plain_greedy(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a row's token is the argmax of its raw logits and nothing else is asked of
    it: greedy, no logprobs, and nothing for ``process_logits`` to do (no logit_bias or
    allowed_token_ids, not under min_tokens, no penalties)."""
    return (params.is_greedy and params.logprobs is None and not params.edits_logits
            and num_output_tokens >= params.min_tokens and not params.needs_penalties
            and params.structured_outputs is None)


def process_logits(raw: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Return ``raw`` [B, V] after each row's allowed_token_ids, logit_bias, min_tokens
    mask, penalties and grammar mask.

    This is what greedy rows take the argmax of. ``raw`` is never modified; it
    is returned as is when no row asked for any of these.
    """
    allowed_rows = [i for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
    has_bias = any(r.params.logit_bias for r in rows)
    has_min_tokens = any(len(r.output_token_ids) < r.params.min_tokens for r in rows)
    penalty_rows = [i for i, r in enumerate(rows) if r.params.needs_penalties]
    grammar_rows = [i for i, r in enumerate(rows) if r.grammar is not None]
    if not (allowed_rows or has_bias or has_min_tokens or penalty_rows or grammar_rows):
        return raw
    logits = raw.clone()
    if allowed_rows:
        apply_allowed_tokens_(logits, allowed_rows,
                              [rows[i].params.allowed_token_ids for i in allowed_rows])
    if has_bias:
        apply_logit_bias_(logits, rows)
    if has_min_tokens:
        apply_min_tokens_(logits, rows)
    if penalty_rows:
        idx = _index_tensor(penalty_rows, logits)
        sub = [rows[i] for i in penalty_rows]
        logits[idx] = apply_penalties(
            logits[idx],
            [r.prompt_token_ids for r in sub],
            [r.output_token_ids for r in sub],
            _row_tensor([r.params.repetition_penalty for r in sub], logits),
            _row_tensor([r.params.frequency_penalty for r in sub], logits),
            _row_tensor([r.params.presence_penalty for r in sub], logits),
        )
    if grammar_rows:
        apply_grammar_masks_(logits, grammar_rows, [rows[i].grammar for i in grammar_rows])
    return logits


def _widen_on_host(logits: torch.Tensor) -> bool:
    return logits.device.type == "cpu"


def apply_grammar_masks_(logits: torch.Tensor, row_ids: list[int], grammars: list[Any]) -> None:
    """Set to -inf, in place, each listed row's tokens that its grammar does not allow
    next. The grammars fill one int32 bitmask on the host (bit ``t % 32`` of word
    ``t // 32`` is token ``t``); it is widened to a boolean mask where the logits are."""
    vocab_size = logits.shape[1]
    bitmask = torch.zeros((len(row_ids), (vocab_size + 31) // 32), dtype=torch.int32)
    for j, grammar in enumerate(grammars):
        grammar.fill(bitmask, j)
    if _widen_on_host(logits):
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
        allowed = torch.from_numpy(bits[:, :vocab_size]).bool()
    else:
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        words = bitmask.to(logits.device, non_blocking=True)
        allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab_size]
    idx = _index_tensor(row_ids, logits)
    logits[idx] = logits[idx].masked_fill(~allowed, _NEG_INF)


def apply_allowed_tokens_(logits: torch.Tensor, row_ids: list[int],
                          allowed: list[list[int]]) -> None:
    """Set to -inf, in place, each listed row's tokens outside its ``allowed`` ids."""
    vocab_size = logits.shape[1]
    pairs = [(j, t) for j, ids in enumerate(allowed) for t in ids if t < vocab_size]
    keep = torch.zeros((len(row_ids), vocab_size), dtype=torch.bool)
    if pairs:
        keep[torch.tensor(pairs).T.unbind()] = True
    idx = _index_tensor(row_ids, logits)
    logits[idx] = logits[idx].masked_fill(~keep.to(logits.device), _NEG_INF)


def apply_logit_bias_(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Add each row's ``logit_bias`` in place, in one indexed add."""
    vocab_size = logits.shape[1]
    row_ids, token_ids, biases = [], [], []
    for i, r in enumerate(rows):
        for token_id, bias in (r.params.logit_bias or {}).items():
            # An id outside this model's vocab can never be sampled: nothing to bias.
            if token_id < vocab_size:
                row_ids.append(i)
                token_ids.append(token_id)
                biases.append(bias)
    index = (_index_tensor(row_ids, logits), _index_tensor(token_ids, logits))
    logits.index_put_(index, _row_tensor(biases, logits), accumulate=True)


def apply_min_tokens_(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Forbid EOS (unless ignore_eos) and stop tokens while a row is under min_tokens."""
    vocab_size = logits.shape[1]
    row_ids, token_ids = [], []
    for i, r in enumerate(rows):
        p = r.params
        if len(r.output_token_ids) >= p.min_tokens:
            continue
        stops = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            stops |= p.eos_token_ids
        kept = [t for t in stops if t < vocab_size]
        row_ids += [i] * len(kept)
        token_ids += kept
    logits[_index_tensor(row_ids, logits), _index_tensor(token_ids, logits)] = _NEG_INF


def token_counts(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """Occurrences of each vocab id in each sequence, as an int32 [len(token_ids), V]."""
    num_rows = len(token_ids)
    lengths = torch.tensor([len(s) for s in token_ids], dtype=torch.long, device=device)
    flat = torch.tensor(list(chain.from_iterable(token_ids)), dtype=torch.long, device=device)
    row_of = torch.repeat_interleave(torch.arange(num_rows, device=device), lengths)
    # One scatter_add over (row, token) pairs flattened into a single index space;
    # int32 halves the memory of a [B, V] count table against int64.
    index = row_of * vocab_size + flat
    counts = torch.zeros(num_rows * vocab_size, dtype=torch.int32, device=device)
    counts.scatter_add_(0, index, torch.ones_like(index, dtype=torch.int32))
    return counts.view(num_rows, vocab_size)


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    repetition_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
) -> torch.Tensor:
    """Return ``logits`` [P, V] with vLLM's repetition, frequency and presence penalties.

    Repetition (HF/vLLM): over ids seen in prompt or output, positive logits are
    divided by the penalty and negative ones multiplied. Frequency subtracts
    ``penalty * count`` and presence subtracts ``penalty`` for ids in the output.
    The penalty tensors are [P] float32, one value per row.
    """
    vocab_size = logits.shape[1]
    output_counts = token_counts(output_token_ids, vocab_size, logits.device)
    seen = output_counts > 0
    if bool((repetition_penalties != 1.0).any()):
        seen_any = seen | (token_counts(prompt_token_ids, vocab_size, logits.device) > 0)
        rep = repetition_penalties.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen_any, penalized, logits)
    logits = logits - frequency_penalties.unsqueeze(1) * output_counts.to(logits.dtype)
    return logits - presence_penalties.unsqueeze(1) * seen.to(logits.dtype)


def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Token id per row: argmax for greedy rows, a filtered random draw for the rest."""
    greedy = [r.params.is_greedy for r in rows]
    if all(greedy):
        return logits.argmax(dim=-1)
    token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    greedy_rows = [i for i, g in enumerate(greedy) if g]
    if greedy_rows:
        idx = _index_tensor(greedy_rows, logits)
        token_ids[idx] = logits[idx].argmax(dim=-1)
    random_rows = [i for i, g in enumerate(greedy) if not g]
    idx = _index_tensor(random_rows, logits)
    token_ids[idx] = _sample_random(logits[idx], [rows[i] for i in random_rows])
    return token_ids


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k/top-p, min-p, then the exponential race, for random rows only."""
    vocab_size = logits.shape[1]
    logits = logits / _row_tensor([r.params.temperature for r in rows], logits).unsqueeze(1)
    if any(r.params.top_k > 0 or r.params.top_p < 1.0 for r in rows):
        # top_k = V and top_p = 1 leave a row untouched, so one call serves mixed batches.
        top_k = [r.params.top_k if r.params.top_k > 0 else vocab_size for r in rows]
        top_p = [r.params.top_p for r in rows]
        logits = apply_top_k_top_p(logits, _index_tensor(top_k, logits), _row_tensor(top_p, logits))
    if any(r.params.min_p > 0.0 for r in rows):
        logits = apply_min_p(logits, _row_tensor([r.params.min_p for r in rows], logits))
    return exponential_race(logits.softmax(dim=-1), [r.generator for r in rows])


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Mask ``logits`` [B, V] to -inf outside each row's top-k and top-p sets.

    ``top_k`` [B] int64 in 1..V (V = off) keeps every id tied with the k-th
    largest. ``top_p`` [B] float32 (1.0 = off) keeps the smallest set of ids whose
    cumulative probability reaches top_p; the top id is always kept.
    """
    vocab_size = logits.shape[1]
    logits_sort, logits_idx = logits.sort(dim=-1)  # ascending, as vLLM
    kth_pos = (vocab_size - top_k.clamp(1, vocab_size)).unsqueeze(1)
    kth_value = logits_sort.gather(1, kth_pos)
    logits_sort.masked_fill_(logits_sort < kth_value, _NEG_INF)
    # Ascending cumsum: an id is dropped when everything up to it adds to <= 1 - top_p.
    cum_probs = logits_sort.softmax(dim=-1).cumsum(dim=-1)
    top_p_mask = cum_probs <= (1.0 - top_p).unsqueeze(1)
    top_p_mask[:, -1] = False
    logits_sort.masked_fill_(top_p_mask, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, logits_idx, logits_sort)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask ids whose probability is below ``min_p * max_prob`` (``min_p`` [B] float32).

    Done in log space: p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p),
    which needs no softmax; min_p = 0 gives log 0 = -inf and masks nothing.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    return logits.masked_fill(logits < threshold, _NEG_INF)


def _exponential(shape: Sequence[int], like: torch.Tensor,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Exponential(1) draws as -log(U), U ~ Uniform[0, 1): the same distribution as
    ``Tensor.exponential_``, which is about 5x slower on the CPU (33 ms for a 32 x 49152
    batch here, a tenth of a decode step)."""
    u = torch.rand(tuple(shape), dtype=like.dtype, device=like.device, generator=generator)
    return u.log_().neg_()


def exponential_race(
    probs: torch.Tensor, generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """Draw one id per row of ``probs`` [B, V] as argmax(probs / q), q ~ Exponential(1).

    This samples exactly from ``probs`` without a cumsum. A row with a generator
    draws its own q of shape [V] (one draw per step), so its result depends only
    on its own probs and seed, never on the batch around it; the other rows
    draw together from the default generator.
    """
    q = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        q = _exponential(probs.shape, probs)
    elif unseeded:
        q[_index_tensor(unseeded, q)] = _exponential((len(unseeded), probs.shape[1]), probs)
    for i, g in enumerate(generators):
        if g is not None:
            q[i] = _exponential(probs.shape[1:], probs, g)
    # q can be exactly 0; 0/0 would be NaN and argmax would pick a masked id.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=-1)


def _make_output(
    raw: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow]
) -> SamplerOutput:
    ks = [r.params.logprobs for r in rows]
    k_max = max((k for k in ks if k is not None), default=None)
    sampled, top_ids, top_vals = _raw_logprobs(raw, token_ids, k_max or 0)
    if k_max is None:
        return SamplerOutput(token_ids.tolist(), sampled.tolist(), None, None)
    ids, vals = top_ids.tolist(), top_vals.tolist()
    lengths = [k or 0 for k in ks]
    return SamplerOutput(
        token_ids.tolist(),
        sampled.tolist(),
        [row[:k] for row, k in zip(ids, lengths, strict=True)],
        [row[:k] for row, k in zip(vals, lengths, strict=True)],
    )


def top_logprobs(raw: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """Each row's top-``k`` token ids and raw logprobs (``raw`` [n, V] logits)."""
    top_vals, top_ids = raw.float().topk(min(k, raw.shape[1]), dim=-1)
    lse = raw.float().logsumexp(dim=-1, keepdim=True)
    return top_ids.tolist(), (top_vals - lse).tolist()


def _raw_logprobs(
    raw: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprob of ``token_ids`` and the top-``k`` ids/logprobs of each row of ``raw``.

    log_softmax(x)_i = x_i - logsumexp(x): a reduction and two gathers, never a
    full [B, V] log-softmax; top-k of the logits is top-k of the logprobs.
    """
    lse = raw.logsumexp(dim=-1, keepdim=True)
    sampled = (raw.gather(1, token_ids.unsqueeze(1)) - lse).squeeze(1)
    top_vals, top_ids = raw.topk(min(k, raw.shape[1]), dim=-1)
    return sampled, top_ids, top_vals - lse


def verify_drafts(logits: torch.Tensor, draft: Sequence[int], params: SamplingParams,
                  generator: torch.Generator | None, grammar: Any = None
                  ) -> tuple[list[int], list[float]]:
    """Speculative decoding's check of one sequence: ``logits`` [len(draft) + 1, V] are the
    target's at the last committed token and at each draft token. Returns the committed
    tokens (the drafts kept, then one of the target's own) and their raw logprobs.

    Greedy keeps a draft while it equals the argmax, so the tokens are greedy decoding's.
    Sampling draws each position's token as the sampler does (the exponential race over
    temperature, top-k/top-p and min-p's distribution, one draw from the sequence's
    generator per position) and keeps a draft while it equals that draw: every committed
    token is the target's own sample, and a seeded sequence draws from its generator
    exactly as often as without speculation, so its tokens are the same. For a proposer
    whose draft is one token (q = 1 there), this keeps a draft with probability p(x), as
    rejection sampling would.

    ``grammar`` (a structured-output matcher): each position is masked as the grammar
    stands after the drafts kept before it, which it is moved past for the purpose and
    rolled back over at the end (the engine moves it past the committed tokens). Where
    a kept draft completes the grammar, that draft is the last token. Only for rows
    ``speculation_allowed`` admits: nothing else changes their logits."""
    from rvllm.spec_decode.rejection import verify_greedy

    raw = logits.float()
    if grammar is None and params.is_greedy:
        tokens = verify_greedy(raw.argmax(dim=-1).tolist(), draft)
    elif grammar is None:
        probs = _sampling_probs(raw, params)
        tokens = []
        for i in range(raw.shape[0]):  # a draw only for positions reached
            tokens.append(int(exponential_race(probs[i:i + 1], [generator])[0]))
            if i == len(draft) or tokens[i] != draft[i]:
                break
    else:
        tokens, moved = [], 0
        try:
            for i in range(raw.shape[0]):
                row = raw[i:i + 1].clone()
                apply_grammar_masks_(row, [0], [grammar])
                tokens.append(int(row.argmax()) if params.is_greedy else
                              int(exponential_race(_sampling_probs(row, params),
                                                   [generator])[0]))
                if i == len(draft) or tokens[i] != draft[i] or not grammar.accept(tokens[i]):
                    break
                moved += 1
                if grammar.is_terminated():
                    break
        finally:
            if moved:
                grammar.rollback(moved)
    lse = raw[: len(tokens)].logsumexp(dim=-1)
    picked = raw[torch.arange(len(tokens)), torch.tensor(tokens)]
    return tokens, (picked - lse).tolist()


def _sampling_probs(raw: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One sequence's rows [n, V] of logits as the distribution its sampling draws from:
    temperature, then top-k/top-p and min-p (as ``_sample_random`` does a batch)."""
    n, vocab_size = raw.shape
    scaled = raw / params.temperature
    if params.top_k > 0 or params.top_p < 1.0:
        top_k = params.top_k if params.top_k > 0 else vocab_size
        scaled = apply_top_k_top_p(scaled, _index_tensor([top_k] * n, raw),
                                   _row_tensor([params.top_p] * n, raw))
    if params.min_p > 0.0:
        scaled = apply_min_p(scaled, _row_tensor([params.min_p] * n, raw))
    return scaled.softmax(dim=-1)


def speculation_allowed(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a sequence's next tokens may be proposed and verified: nothing may make
    one position's logits depend on the tokens before it beyond the model itself and its
    grammar (no penalties, logit_bias, allowed_token_ids, min_tokens still due)."""
    return (not params.edits_logits and not params.needs_penalties
            and num_output_tokens >= params.min_tokens)


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor, k: int
) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """Raw logprobs for prompt positions.

    ``logits`` [T, V] are the model's outputs at T prompt positions and
    ``next_token_ids`` [T] the tokens that actually follow them. Returns, per
    position, the logprob of that next token and the top-``k`` ids and logprobs
    (largest first).
    """
    sampled, top_ids, top_vals = _raw_logprobs(
        logits.float(), next_token_ids.to(logits.device, torch.long), k
    )
    return sampled.tolist(), top_ids.tolist(), top_vals.tolist()


def _row_tensor(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=like.device)


def _index_tensor(values: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)
