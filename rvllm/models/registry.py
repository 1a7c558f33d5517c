"""Which model class serves which Hugging Face architecture name."""

from __future__ import annotations

from torch import nn

_MODELS: dict[str, tuple[str, str]] = {
    "DeepseekV2ForCausalLM": ("rvllm.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "GemmaForCausalLM": ("rvllm.models.gemma", "GemmaForCausalLM"),
    "Gemma2ForCausalLM": ("rvllm.models.gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("rvllm.models.gemma", "Gemma3ForCausalLM"),
    "Gemma4ForCausalLM": ("rvllm.models.gemma4", "Gemma4ForCausalLM"),
    "LlamaForCausalLM": ("rvllm.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("rvllm.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("rvllm.models.llama", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("rvllm.models.mixtral", "MixtralForCausalLM"),
    "PhiForCausalLM": ("rvllm.models.phi", "PhiForCausalLM"),
    "Phi3ForCausalLM": ("rvllm.models.phi3", "Phi3ForCausalLM"),
    "Qwen3ForCausalLM": ("rvllm.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("rvllm.models.qwen3_moe", "Qwen3MoeForCausalLM"),
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
