"""Sampling parameters for one request, with vLLM's field names and validation."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from rvllm.lora.request import LoRARequest

_SAMPLING_EPS = 1e-5

# The constraint kinds of StructuredOutputsParams, exactly one of which a request sets.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """A constraint on the completion's text, as vLLM names it: exactly one of

    - ``json``: a JSON schema (a dict, or its JSON text) the output must validate against;
    - ``regex``: a regular expression the whole output must match;
    - ``choice``: a list of strings, one of which is the output;
    - ``grammar``: a context-free grammar, in Lark syntax (or GBNF/EBNF with ``::=``);
    - ``json_object``: ``True`` for any JSON object.

    ``starts_after``: token ids after which the constraint applies, the output before
    them and they themselves free (a reasoning model's end of thinking, which the server
    sets under ``--reasoning-parser``); None: from the first token.
    ``disable_any_whitespace`` keeps JSON to compact separators (no free whitespace);
    ``disable_additional_properties`` treats a schema's objects as closed unless they say
    otherwise; ``whitespace_pattern`` is a regex for the whitespace JSON may use.
    Each token's allowed set comes from a grammar engine (``--structured-outputs-config``).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    starts_after: list[int] | None = None

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_OUTPUT_KINDS
                 if getattr(self, k) is not None and getattr(self, k) is not False]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar or "
                f"json_object; got {', '.join(given) or 'none'}.")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}.") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object).")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured_outputs.regex must be a string.")
        if self.grammar is not None and (not isinstance(self.grammar, str)
                                         or not self.grammar.strip()):
            raise ValueError("structured_outputs.grammar must be a non-empty string.")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "non-empty strings.")
            self.choice = list(self.choice)
        if self.json_object not in (None, True):
            raise ValueError("structured_outputs.json_object may only be true.")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ValueError("structured_outputs.whitespace_pattern must be a string.")
        if self.starts_after is not None:
            self.starts_after = _token_ids("structured_outputs.starts_after", self.starts_after)

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``STRUCTURED_OUTPUT_KINDS``."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS
                    if getattr(self, k) is not None and getattr(self, k) is not False)

    def key(self) -> str:
        """A canonical text of the constraint and its options: compiled grammars are
        cached under it."""
        return json.dumps([self.kind, getattr(self, self.kind), self.disable_any_whitespace,
                           self.disable_additional_properties, self.whitespace_pattern],
                          sort_keys=True, separators=(",", ":"))


@dataclass
class SamplingParams:
    """How to sample the completion of one prompt.

    Field names and defaults follow vLLM. Invalid values raise ``ValueError``
    naming the field and the allowed range.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    # Only these tokens may be sampled (vLLM's allowed_token_ids).
    allowed_token_ids: list[int] | None = None
    # Keep the prompt's last this many tokens (-1: max_model_len's worth); None: all.
    truncate_prompt_tokens: int | None = None
    # Under --scheduling-policy priority: lower runs first (vLLM's request priority, which
    # LLM.generate(priority=...) and the API's priority field set here).
    priority: int = 0
    # The LoRA adapter the request runs with (vLLM's lora_request, which
    # LLM.generate(lora_request=...) and the API's model field set here); None: the base.
    lora_request: LoRARequest | None = None
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine: EOS ids of the model, honoured unless ignore_eos.
    eos_token_ids: frozenset[int] = field(default_factory=frozenset, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            unknown = set(self.structured_outputs) - set(StructuredOutputsParams.__annotations__)
            if unknown:
                raise ValueError(f"structured_outputs has no field {sorted(unknown)[0]!r}.")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        elif not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise ValueError("structured_outputs must be a StructuredOutputsParams or a dict.")
        if self.top_k == -1:  # vLLM's older spelling of "disabled"
            self.top_k = 0
        self._verify()

    def _verify(self) -> None:
        _check_int("n", self.n, low=1)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than 0, got {self.repetition_penalty}."
            )
        _check_number("temperature", self.temperature)
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        _check_int("top_k", self.top_k, low=0, hint="0 or -1 disables top_k")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=0)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}.")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, low=0)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("logit_bias must be a mapping of token id to bias.")
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            for k, v in self.logit_bias.items():
                if k < 0:
                    raise ValueError(f"logit_bias keys must be token ids >= 0, got {k}.")
                if not -100.0 <= v <= 100.0:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {v}.")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids)
        _check_int("priority", self.priority)
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, low=-1)
            if self.truncate_prompt_tokens == 0:
                raise ValueError("truncate_prompt_tokens must be at least 1, or -1 for the "
                                 "model's maximum context length.")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def edits_logits(self) -> bool:
        """Whether ``logit_bias`` or ``allowed_token_ids`` change the logits."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    @property
    def needs_penalties(self) -> bool:
        return (
            abs(self.presence_penalty) > _SAMPLING_EPS
            or abs(self.frequency_penalty) > _SAMPLING_EPS
            or abs(self.repetition_penalty - 1.0) > _SAMPLING_EPS
        )

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)


def _token_ids(name: str, value: object) -> list[int]:
    """``value`` as a non-empty list of token ids (integers >= 0); ValueError names it."""
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{name} must be a non-empty list of token ids.")
    for t in value:
        _check_int(name, t, low=0)
    return list(value)


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}.")


def _check_range(name: str, value: float, low: float, high: float) -> None:
    _check_number(name, value)
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}.")


def _check_int(name: str, value: object, low: int | None = None, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}.")
    if low is not None and value < low:
        extra = f" ({hint})" if hint else ""
        raise ValueError(f"{name} must be at least {low}{extra}, got {value}.")
