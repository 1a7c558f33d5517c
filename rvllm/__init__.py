"""rvllm: a from-scratch LLM inference and serving engine in the class of vLLM."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Heavy modules load on first use, so `rvllm --help` and the CPU sampling API start fast.
_EXPORTS = {
    "LLM": "rvllm.engine.llm",
    "LLMEngine": "rvllm.engine.llm_engine",
    "EngineArgs": "rvllm.config",
    "SamplingParams": "rvllm.sampling_params",
    "StructuredOutputsParams": "rvllm.sampling_params",
    "PoolingParams": "rvllm.pooling_params",
    "RequestOutput": "rvllm.outputs",
    "EmbeddingRequestOutput": "rvllm.outputs",
    "CompletionOutput": "rvllm.outputs",
    "Sampler": "rvllm.sampler",
    "sample_batch": "rvllm.sampler",
    "Tokenizer": "rvllm.tokenizer",
}

__all__ = [
    "LLM", "LLMEngine", "EngineArgs", "SamplingParams", "StructuredOutputsParams",
    "PoolingParams", "RequestOutput", "EmbeddingRequestOutput", "CompletionOutput", "Sampler",
    "sample_batch", "Tokenizer", "__version__",
]

if TYPE_CHECKING:
    from rvllm.config import EngineArgs
    from rvllm.engine.llm import LLM
    from rvllm.engine.llm_engine import LLMEngine
    from rvllm.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput
    from rvllm.pooling_params import PoolingParams
    from rvllm.sampler import Sampler, sample_batch
    from rvllm.sampling_params import SamplingParams, StructuredOutputsParams
    from rvllm.tokenizer import Tokenizer


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rvllm' has no attribute {name!r}")
