"""Embeddings: a request's pooling parameters and the engine's pooler, with vLLM's names.

An engine started as a pooling model (``--runner pooling``, or ``--convert embed``) runs
each prompt through the model once and answers with one vector, pooled from the final
norm's hidden states: the last token's (``LAST``, the default for a decoder), their mean
(``MEAN``) or the first token's (``CLS``), L2-normalized unless told otherwise. A
Sentence Transformers folder's ``modules.json`` sets the pooling and the normalization it
was trained with; ``--pooler-config`` sets them over everything.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rvllm.json_options import json_options, read_json_file
from rvllm.sampling_params import _check_int

# What --runner and --convert may name. A causal LM runs as a pooling model only through
# the embed conversion (its LM head left unused).
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed")
POOLING_TYPES = ("LAST", "MEAN", "CLS")

# Sentence Transformers' pooling modes that rvllm computes, and their pooling type.
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_cls_token": "CLS"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens")


@dataclass
class PoolingParams:
    """One embedding request's parameters.

    - ``truncate_prompt_tokens``: keep only the prompt's last k tokens (-1: the model's
      context length); None keeps it whole (and a prompt longer than the context is
      refused).
    - ``dimensions``: the embedding cut to its first k values before normalization
      (Matryoshka models only: the model's config lists ``matryoshka_dimensions`` or sets
      ``is_matryoshka``).
    - ``normalize``: L2-normalize the vector; None follows the engine's pooler.
    """

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, low=-1)
            if self.truncate_prompt_tokens == 0:
                raise ValueError("truncate_prompt_tokens must be at least 1, or -1 for the "
                                 "model's maximum context length.")
        if self.dimensions is not None:
            _check_int("dimensions", self.dimensions, low=1)
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}.")

    def clone(self) -> PoolingParams:
        return copy.deepcopy(self)


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """How the engine pools: ``pooling_type`` (LAST, MEAN or CLS) and whether vectors are
    L2-normalized by default."""

    pooling_type: str = "LAST"
    normalize: bool = True

    @classmethod
    def resolve(cls, model_path: str, override: dict | str | None) -> PoolerConfig:
        """The defaults, then a Sentence Transformers folder's own (``modules.json``),
        then ``override`` (``--pooler-config``: JSON text or a dict). ValueError names
        what is wrong."""
        values: dict[str, Any] = {"pooling_type": "LAST", "normalize": True}
        values.update(_sentence_transformers(Path(model_path)))
        if override is not None:
            values.update(json_options(override, "pooler_config", cls.__slots__))
        kind = values["pooling_type"]
        if not isinstance(kind, str) or kind.upper() not in POOLING_TYPES:
            raise ValueError(f"pooler_config pooling_type must be one of "
                             f"{', '.join(POOLING_TYPES)}; got {kind!r}.")
        if not isinstance(values["normalize"], bool):
            raise ValueError("pooler_config normalize must be true or false.")
        return cls(kind.upper(), values["normalize"])


def resolve_runner(runner: str, convert: str) -> str:
    """``--runner`` and ``--convert`` as what the engine runs: "generate" or "pooling".
    ``auto`` is generate: every architecture rvllm loads is a causal LM."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}; got {runner!r}.")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {', '.join(CONVERTS)}; got {convert!r}.")
    if convert == "embed":
        if runner == "generate":
            raise ValueError("convert='embed' makes a pooling model: it does not go with "
                             "runner='generate'.")
        return "pooling"
    if runner == "pooling":
        if convert == "none":
            raise ValueError("rvllm's models pool through the embed conversion: with "
                             "runner='pooling' leave convert as auto (or embed).")
        return "pooling"
    return "generate"


def score_pairs(num_first: int, num_second: int) -> list[tuple[int, int]]:
    """vLLM's pairing of a score request's two sides: one first text against each
    second text, or the two lists zipped. Indices into the first list, then into the
    second; ValueError where the lengths do not pair."""
    if num_first == 0 or num_second == 0:
        raise ValueError("text_1 and text_2 must each hold at least one text.")
    if num_first == 1:
        return [(0, j) for j in range(num_second)]
    if num_first != num_second:
        raise ValueError(f"text_1 and text_2 must have the same length (or text_1 one "
                         f"text); got {num_first} and {num_second}.")
    return [(i, i) for i in range(num_first)]


def cosine_similarity(a: list[float], b: list[float]) -> float:
    """The cosine of the angle between two vectors (0 where either is all zeros)."""
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


def matryoshka_dimensions(hf_config: dict[str, Any]) -> list[int] | None:
    """The sizes a Matryoshka model's embeddings may be cut to; [] where any size may
    be asked for (``is_matryoshka`` without a list); None where the model is not one."""
    sizes = hf_config.get("matryoshka_dimensions")
    if isinstance(sizes, list) and sizes:
        return [int(s) for s in sizes]
    return [] if hf_config.get("is_matryoshka") else None


def _sentence_transformers(folder: Path) -> dict[str, Any]:
    """The pooling type and normalization a Sentence Transformers model folder declares
    (its ``modules.json`` and the Pooling module's config); {} where it declares none."""
    modules_path = folder / "modules.json"
    if not folder.is_dir() or not modules_path.is_file():
        return {}
    modules = read_json_file(modules_path, list, "a list of modules")
    types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules
             if isinstance(m, dict)}
    values: dict[str, Any] = {"normalize": "Normalize" in types}
    pooling = types.get("Pooling")
    if pooling is None:
        return values
    config_path = folder / str(pooling.get("path", "")) / "config.json"
    config = read_json_file(config_path)
    for mode in _ST_UNSUPPORTED:
        if config.get(mode):
            raise ValueError(f"{config_path}: {mode} is not supported; rvllm pools by the "
                             "last token, the mean or the first token (--pooler-config "
                             "sets one).")
    for mode, kind in _ST_MODES.items():
        if config.get(mode):
            values["pooling_type"] = kind
            break
    return values
