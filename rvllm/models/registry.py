"""Which model class serves which Hugging Face architecture name."""

from __future__ import annotations

from torch import nn

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("rvllm.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("rvllm.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("rvllm.models.llama", "LlamaForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def check_architecture(name: str) -> str:
    if name not in _MODELS:
        raise ValueError(
            f"Model architecture {name!r} is not supported; supported architectures: "
            f"{', '.join(supported_architectures())}."
        )
    return name


def get_model_class(name: str) -> type[nn.Module]:
    import importlib

    module, cls = _MODELS[check_architecture(name)]
    return getattr(importlib.import_module(module), cls)
