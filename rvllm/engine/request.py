"""A live request as the engine holds it (its sequences, metrics and what the caller has
been sent), and the ``RequestOutput`` made from it after each step that moved it."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from rvllm.engine.sequence import Sequence
from rvllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from rvllm.pooling_params import PoolingParams
from rvllm.sampling_params import SamplingParams
from rvllm.tokenizer import Tokenizer


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    sent_tokens: list[int] = field(default_factory=list)
    grammar: Future | None = None  # its structured-output grammar, compiling or compiled
    pooling: PoolingParams | None = None  # an embedding's parameters

    @property
    def finished(self) -> bool:
        return all(s.status.is_finished for s in self.seqs)


def make_output(request: Request, now: float) -> RequestOutput:
    """Every sequence's text and tokens so far; ``new_token_counts`` (and
    ``request.sent_tokens``) count what is new since the last output. A finished request
    gets its finish time."""
    finished = request.finished
    outputs = []
    counts = []
    for seq in request.seqs:
        outputs.append(CompletionOutput(
            index=seq.index,
            text=visible_text(seq),
            token_ids=seq.output_token_ids,
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=seq.logprobs,
            finish_reason=seq.status.finish_reason,
            stop_reason=seq.stop_reason,
        ))
        counts.append(seq.num_output_tokens - request.sent_tokens[seq.index])
        request.sent_tokens[seq.index] = seq.num_output_tokens
    if finished:
        request.metrics.finished_time = now
    first = request.seqs[0]
    return RequestOutput(
        request_id=request.request_id,
        prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids,
        prompt_logprobs=first.prompt_logprobs,
        outputs=outputs,
        finished=finished,
        metrics=request.metrics,
        num_cached_tokens=first.num_cached_tokens,
        new_token_counts=counts,
        pooled=first.pooled,
    )


def visible_text(seq: Sequence) -> str:
    """While a stop string could still be forming at the end, hold that tail back."""
    stops = seq.params.stop
    if seq.status.is_finished or not stops or seq.params.include_stop_str_in_output:
        return seq.text
    hold = max(len(s) for s in stops) - 1
    return seq.text[: max(0, len(seq.text) - hold)] if hold else seq.text


def logprob_entry(tokenizer: Tokenizer | None, token: int, logprob: float,
                  top_ids: list[int] | None, top_lps: list[float] | None
                  ) -> dict[int, Logprob]:
    """One position's logprobs: the chosen token first (as vLLM orders them), then the
    top ones with their ranks, each with its text where there is a tokenizer."""
    entry: dict[int, Logprob] = {}
    rank = None
    for r, (tid, lp) in enumerate(zip(top_ids or [], top_lps or []), start=1):
        entry[tid] = Logprob(lp, r, _decode_one(tokenizer, tid))
        if tid == token:
            rank = r
    chosen = entry.get(token)
    entry[token] = Logprob(logprob, rank if chosen is None else chosen.rank,
                           _decode_one(tokenizer, token))
    return {token: entry[token], **{k: v for k, v in entry.items() if k != token}}


def _decode_one(tokenizer: Tokenizer | None, token_id: int) -> str | None:
    if tokenizer is None:
        return None
    return tokenizer.decode([token_id], skip_special_tokens=False)
