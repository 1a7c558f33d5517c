"""Public CPU sampling API: sample from plain logits without an engine.

A thin front over the batched device sampler in ``rvllm.layers.sampler``: the
arguments become a ``SamplingParams`` (so bad values raise the same
``ValueError`` naming the field) and the logits go through the same filters.
Logits may be numpy arrays, torch tensors or lists of floats; temperature 0
means greedy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rvllm.layers import sampler as batch_sampler
from rvllm.layers.sampler import SamplingRow
from rvllm.sampling_params import SamplingParams

__all__ = ["Sampler", "apply_penalties", "sample_batch"]

_BATCH_SAMPLER = batch_sampler.Sampler()


class Sampler:
    """Samples one token id from a 1-D row of logits."""

    def sample(
        self,
        logits: Any,
        *,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int | None = None,
    ) -> int:
        """Return a token id drawn from ``logits`` [V] after temperature and filters.

        With ``seed`` set the result is reproducible: it is what ``sample_batch``
        gives for a row seeded with the same value.
        """
        row = _as_logits(logits, ndim=1, name="logits").unsqueeze(0)
        params = _params(temperature, top_k, top_p, min_p, seed)
        return _sample_rows(row, params, seed)[0]


def sample_batch(
    logits_batch: Any,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
) -> list[int]:
    """Return one token id per row of ``logits_batch`` [B, V].

    Row ``i`` is seeded with ``seed + i``, so it equals
    ``Sampler().sample(logits_batch[i], seed=seed + i)``.
    """
    logits = _as_logits(logits_batch, ndim=2, name="logits_batch")
    params = _params(temperature, top_k, top_p, min_p, seed)
    return _sample_rows(logits, params, seed)


def apply_penalties(
    logits: Any,
    token_ids: Sequence[int],
    *,
    repetition_penalty: float = 1.0,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
) -> Any:
    """Return new logits [V] with vLLM's penalties over the tokens in ``token_ids``.

    ``token_ids`` are the tokens seen so far: repetition divides positive
    (multiplies negative) logits of every seen id, frequency subtracts
    ``penalty * count`` and presence subtracts ``penalty`` once per seen id.
    The result has the input's kind (numpy array, tensor or list); the
    arithmetic is float32.
    """
    # Validation only: SamplingParams names the bad field and its range.
    SamplingParams(
        repetition_penalty=repetition_penalty,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
    )
    row = _as_logits(logits, ndim=1, name="logits").unsqueeze(0)
    token_ids = [int(t) for t in token_ids]
    if any(not 0 <= t < row.shape[1] for t in token_ids):
        raise ValueError(f"token_ids must be in [0, {row.shape[1]}), got {token_ids}.")
    penalized = batch_sampler.apply_penalties(
        row,
        [[]],
        [token_ids],
        torch.tensor([repetition_penalty]),
        torch.tensor([frequency_penalty]),
        torch.tensor([presence_penalty]),
    )[0]
    if isinstance(logits, torch.Tensor):
        return penalized.to(logits.dtype)
    if isinstance(logits, np.ndarray):
        return penalized.numpy().astype(logits.dtype)
    return penalized.tolist()


def _params(
    temperature: float, top_k: int, top_p: float, min_p: float, seed: int | None
) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)


def _sample_rows(logits: torch.Tensor, params: SamplingParams, seed: int | None) -> list[int]:
    rows = [
        SamplingRow(
            params, (), (), None if seed is None else torch.Generator().manual_seed(seed + i)
        )
        for i in range(logits.shape[0])
    ]
    if not rows:
        return []
    return _BATCH_SAMPLER(logits, rows).sampled_token_ids


def _as_logits(logits: Any, ndim: int, name: str) -> torch.Tensor:
    """``logits`` as a float32 CPU tensor of ``ndim`` dims, or a ValueError naming it."""
    try:
        t = torch.as_tensor(np.asarray(logits) if isinstance(logits, list) else logits)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{name} must be an array of floats: {e}") from None
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}.")
    if t.shape[-1] == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(t.shape)}.")
    if t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"{name} must hold floats, got dtype {t.dtype}.")
    t = t.detach().to("cpu", torch.float32)
    # +inf or NaN would turn the softmax into NaN; -inf is a legitimate mask.
    if bool((t.isnan() | (t == float("inf"))).any()):
        raise ValueError(f"{name} must not contain NaN or +inf.")
    return t
