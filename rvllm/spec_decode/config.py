"""``--speculative-config`` / ``LLM(speculative_config=...)``: vLLM's JSON, checked."""

from __future__ import annotations

from dataclasses import dataclass

from rvllm.json_options import json_options

SPECULATIVE_METHODS = ("ngram", "draft_model", "self_draft")


@dataclass(slots=True)
class SpeculativeConfig:
    """How a request's next tokens are proposed before the target model checks them.

    ``method``: ``ngram`` (prompt lookup over the prompt and the output so far),
    ``draft_model`` (a smaller model with the same vocabulary, ``model``) or
    ``self_draft`` (the target's first ``num_draft_layers`` layers and its LM head).
    ``num_speculative_tokens`` is k, the tokens proposed per step.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    num_draft_layers: int | None = None
    # Steps with more running sequences than this do not speculate (vLLM's name): a
    # wide batch already reads each weight once for many tokens.
    disable_by_batch_size: int = 4

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From the flag's JSON text or a dict; ValueError names what is wrong."""
        if value is None or isinstance(value, cls):
            return value
        fields = json_options(value, "speculative_config",
                              cls.__slots__)  # type: ignore[attr-defined]
        if fields.get("method") == "[ngram]":  # vLLM's older spelling
            fields["method"] = "ngram"
        if "method" not in fields or "num_speculative_tokens" not in fields:
            raise ValueError("speculative_config needs method and num_speculative_tokens.")
        config = cls(**fields)
        config.check()
        return config

    def check(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method {self.method!r} is not one of "
                             f"{', '.join(SPECULATIVE_METHODS)}.")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "disable_by_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config {name} must be an integer of at least "
                                 f"1, got {value!r}.")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) "
                             f"must not exceed prompt_lookup_max ({self.prompt_lookup_max}).")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config method draft_model needs model, the draft's "
                             "path.")
        if self.num_draft_layers is not None and (
                isinstance(self.num_draft_layers, bool)
                or not isinstance(self.num_draft_layers, int) or self.num_draft_layers < 1):
            raise ValueError("speculative_config num_draft_layers must be an integer of at "
                             f"least 1, got {self.num_draft_layers!r}.")

    def draft_layers(self, num_layers: int) -> int:
        """Self-draft's layers for a target of ``num_layers``: as set (fewer than the
        target's), else a quarter of them."""
        n = self.num_draft_layers if self.num_draft_layers is not None else max(1,
                                                                                num_layers // 4)
        if n >= num_layers:
            raise ValueError(f"speculative_config num_draft_layers ({n}) must be below the "
                             f"model's {num_layers} layers.")
        return n
