"""Beam search, as vLLM runs it: outside the engine, one token at a time.

Each step asks the engine for one token of every live beam (``max_tokens=1``) with the
top ``2 * beam_width`` logprobs of its next position; the prefix cache holds each beam's
tokens, so a step computes little more than the new position. Every beam's candidates
(the beam plus one of those tokens) are ranked together by their score, the cumulative
logprob over the length to the power ``length_penalty`` (the length counts the prompt,
as vLLM counts it); the best ``beam_width`` that did not end with EOS live on, and those
that did are set aside as finished. After ``max_tokens`` steps (or when no beam is left)
the best ``beam_width`` of the finished and the live ones, by the same score, are the
result, best first.

``BeamSearch`` holds one prompt's search; ``LLM.beam_search`` and the server's
``use_beam_search`` drive it with their engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rvllm.lora.request import LoRARequest
from rvllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from rvllm.sampling_params import SamplingParams, _check_int, _check_number

if TYPE_CHECKING:
    from rvllm.tokenizer import Tokenizer


@dataclass
class BeamSearchParams:
    """vLLM's: ``beam_width`` beams (and results), ``max_tokens`` new tokens at most
    (None: the rest of the context), EOS ignored with ``ignore_eos``, and the score's
    ``length_penalty``. ``temperature`` changes nothing: candidates are ranked by the
    model's own logprobs."""

    beam_width: int
    max_tokens: int | None
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width, low=1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
        _check_number("length_penalty", self.length_penalty)
        _check_number("temperature", self.temperature)


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` are the prompt's and then the beam's own; ``logprobs`` one
    entry per own token (the token's logprob, with the other candidates of its position).
    ``text`` is filled in for results."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def beam_score(seq: BeamSearchSequence, eos_token_ids: frozenset[int],
               length_penalty: float) -> float:
    """The cumulative logprob over the length (prompt included, a final EOS not) to the
    power ``length_penalty``."""
    length = len(seq.tokens) - (1 if seq.tokens[-1] in eos_token_ids else 0)
    return seq.cum_logprob / (length ** length_penalty)


class BeamSearch:
    """One prompt's search. ``beams`` are the live ones; ``step_params`` are what the
    engine runs each of them with; ``advance`` takes each beam's output of a step.
    ValueError where the prompt leaves no room for ``max_tokens`` in ``max_model_len``."""

    def __init__(self, prompt_ids: list[int], params: BeamSearchParams,
                 eos_token_ids: frozenset[int], max_model_len: int,
                 lora_request: LoRARequest | None = None) -> None:
        if not prompt_ids:
            raise ValueError("prompt is empty: give at least one token.")
        self.max_tokens = (max_model_len - len(prompt_ids) if params.max_tokens is None
                           else params.max_tokens)
        if self.max_tokens < 1 or len(prompt_ids) + self.max_tokens > max_model_len:
            raise ValueError(
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"you requested {len(prompt_ids) + max(self.max_tokens, 1)} tokens "
                f"({len(prompt_ids)} in the prompt, {max(self.max_tokens, 1)} for the "
                "beams).")
        self.prompt_ids = list(prompt_ids)
        self.lora_request = lora_request
        self.params = params
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.beams = [BeamSearchSequence(list(prompt_ids))]
        self.finished: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.beams or self.steps >= self.max_tokens

    def step_params(self) -> SamplingParams:
        """One greedy token, with the top ``2 * beam_width`` logprobs of its position."""
        return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                              logprobs=2 * self.params.beam_width, detokenize=False,
                              lora_request=self.lora_request)

    def advance(self, outputs: list[RequestOutput]) -> None:
        """Each live beam's one-token output, in the order of ``beams``."""
        assert len(outputs) == len(self.beams)
        candidates = []
        for beam, out in zip(self.beams, outputs):
            entries = out.outputs[0].logprobs
            assert entries, "a beam's step returned no logprobs"
            entry = entries[0]
            for token, lp in entry.items():
                if lp.rank is None or lp.rank > 2 * self.params.beam_width:
                    continue  # the sampled token, when it is not a top one
                candidates.append(BeamSearchSequence(
                    beam.tokens + [token], beam.logprobs + [entry],
                    beam.cum_logprob + lp.logprob))
        candidates.sort(key=self._score, reverse=True)
        live: list[BeamSearchSequence] = []
        for seq in candidates[:self.params.beam_width]:
            if seq.tokens[-1] in self.eos_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", seq.tokens[-1]
                self.finished.append(seq)
            else:
                live.append(seq)
        self.beams = live
        self.steps += 1

    def results(self, tokenizer: Tokenizer | None) -> list[BeamSearchSequence]:
        """The best ``beam_width`` beams, finished or not, best first, each with the text
        of its own tokens (a final EOS's only with ``include_stop_str_in_output``)."""
        for seq in self.beams:
            seq.finish_reason = "length"
        ranked = sorted(self.finished + self.beams, key=self._score, reverse=True)
        best = ranked[:self.params.beam_width]
        if tokenizer is not None:
            for seq in best:
                own = seq.tokens[len(self.prompt_ids):]
                if seq.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                    own = own[:-1]
                seq.text = tokenizer.decode(own)
        return best

    def _score(self, seq: BeamSearchSequence) -> float:
        return beam_score(seq, self.eos_token_ids, self.params.length_penalty)


def pending_beams(searches: list[BeamSearch]) -> list[tuple[BeamSearch, BeamSearchSequence]]:
    """The next step's work: every live beam of each search not done, search by search."""
    return [(s, beam) for s in searches if not s.done for beam in s.beams]


def advance_all(pending: list[tuple[BeamSearch, BeamSearchSequence]],
                outputs: list[RequestOutput]) -> None:
    """Each search's beams' one-token outputs (in ``pending``'s order) handed to it."""
    start = 0
    while start < len(pending):
        search = pending[start][0]
        count = len(search.beams)
        search.advance(outputs[start:start + count])
        start += count


def as_request_output(request_id: str, prompt: str | None, prompt_ids: list[int],
                      beams: list[BeamSearchSequence], arrival_time: float) -> RequestOutput:
    """A search's results as one finished RequestOutput, a completion per beam (best
    first), for the server's response builders."""
    outputs = [CompletionOutput(index=i, text=beam.text or "",
                                token_ids=beam.tokens[len(prompt_ids):],
                                cumulative_logprob=beam.cum_logprob, logprobs=None,
                                finish_reason=beam.finish_reason,
                                stop_reason=beam.stop_reason)
               for i, beam in enumerate(beams)]
    return RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=prompt_ids,
                         prompt_logprobs=None, outputs=outputs, finished=True,
                         metrics=RequestMetrics(arrival_time=arrival_time))
