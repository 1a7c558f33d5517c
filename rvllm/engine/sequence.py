"""A sequence: one sample of one request, the unit the scheduler moves around."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from rvllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from rvllm.tokenizer import IncrementalDetokenizer


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()  # preempted with its KV blocks copied out to CPU swap space
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # its structured-output grammar could not go on

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_ERROR: "error",
}
_FINISHED = frozenset(_FINISH_REASONS)


@dataclass(eq=False)
class Sequence:
    """Token ids are the prompt followed by the output so far. ``num_computed_tokens``
    of them have their K/V in the cache; the rest are computed by coming steps."""

    seq_id: int
    request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    max_tokens: int
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    grammar: Any = None  # the structured-output matcher, once its grammar is compiled
    # Speculative decoding: this step's proposed tokens, appended to token_ids until the
    # step has verified them; and how many steps to wait before proposing again.
    spec_tokens: list[int] = field(default_factory=list)
    spec_backoff: int = 0
    spec_skip: int = 0
    spec_gain: float | None = None  # tokens per verifying step, averaged over the last few
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    cpu_block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    stop_reason: int | str | None = None
    text: str = ""
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Any]] | None = None
    prompt_logprobs: list[dict[int, Any] | None] | None = None
    num_preemptions: int = 0
    # --async-scheduling: the token in flight is its last (max_tokens, max_model_len).
    ends_in_flight: bool = False
    # A pooling request's (an embedding's): its pooling type (LAST, MEAN, CLS), the sum of
    # the hidden states pooled so far and how many positions they are (MEAN: positions
    # 0..pool_count-1), and once the prompt is through, the vector.
    pooling: str | None = None
    pool_sum: Any = None
    pool_count: int = 0
    pooled: list[float] | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Still owes prompt logprobs for some prompt positions."""
        return (
            self.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_prompt_tokens
        )

    @property
    def lora_id(self) -> int:
        """Its LoRA adapter's id; 0: the base model."""
        lora = self.params.lora_request
        return 0 if lora is None else lora.lora_int_id

    @property
    def needs_every_prompt_row(self) -> bool:
        """Computes every prompt position itself (prompt logprobs, mean or first-token
        pooling): no prefix-cache hit may skip any."""
        return self.prompt_logprobs is not None or self.pooling in ("MEAN", "CLS")

    def reset_for_recompute(self) -> None:
        """Preempted: its cache is gone, so every token is recomputed on resumption."""
        self.block_table = []
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1
