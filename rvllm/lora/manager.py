"""PEFT LoRA adapters read and put on a model's linear layers, once per adapter.

A PEFT folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
``use_rslora``) and ``adapter_model.safetensors``, whose tensors are named after the
Hugging Face modules they adapt (``base_model.model.model.layers.0.self_attn.q_proj.
lora_A.weight``). Each module's pair becomes a ``LoRASlice`` of the rvllm layer that
holds it: a fused QKV or gate/up projection takes each part's pair at that part's output
rows. The scale (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA) is folded into B.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rvllm.json_options import read_json_file
from rvllm.lora.layers import LoRASlice
from rvllm.lora.request import LoRARequest
from rvllm.models.base import stacked_target

# The projections an adapter may adapt: attention's and the MLP's.
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])"
                  r"(?:\.[^.]+)?\.weight$")


class LoRAManager:
    """The adapters loaded into ``model``, by id, least recently used first; each is read
    on its first request. Past ``max_cpu_loras`` of them, loading one drops the least
    recently used that no live request runs (vLLM's ``--max-cpu-loras``)."""

    def __init__(self, model: nn.Module, max_lora_rank: int, device: torch.device,
                 dtype: torch.dtype, max_cpu_loras: int | None = None) -> None:
        self.model = model
        self.max_lora_rank = max_lora_rank
        self.device = device
        self.dtype = dtype
        self.max_cpu_loras = max_cpu_loras
        self.loaded: dict[int, LoRARequest] = {}
        self._modules: dict[int, list[str]] = {}  # the layers each adapter is on

    def ensure(self, request: LoRARequest, in_use: set[int] | None = None) -> None:
        """Load ``request``'s adapter unless it is loaded (then it becomes the most
        recently used); ValueError names what is wrong with it (and leaves nothing of it
        on the model). ``in_use``: the adapters live requests run, never dropped."""
        lora_id = request.lora_int_id
        known = self.loaded.get(lora_id)
        if known is not None:
            if (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
                raise ValueError(f"lora_int_id {lora_id} is already the adapter "
                                 f"{known.lora_name!r} ({known.lora_path}).")
            self.loaded[lora_id] = self.loaded.pop(lora_id)  # most recently used
            return
        slices = self._read(request)
        self._make_room(in_use or set())
        for name, parts in slices.items():
            module = self.model.get_submodule(name)
            if module.lora_weights is None:
                module.lora_weights = {}
            module.lora_weights[lora_id] = parts
        self.loaded[lora_id] = request
        self._modules[lora_id] = list(slices)

    def remove(self, lora_id: int) -> None:
        """Take an adapter off the model (its memory goes with it)."""
        self.loaded.pop(lora_id, None)
        for name in self._modules.pop(lora_id, []):
            weights = self.model.get_submodule(name).lora_weights
            weights.pop(lora_id, None)

    def _make_room(self, in_use: set[int]) -> None:
        """Below ``max_cpu_loras`` adapters, dropping the least recently used idle ones."""
        if self.max_cpu_loras is None:
            return
        for lora_id in list(self.loaded):
            if len(self.loaded) < self.max_cpu_loras:
                return
            if lora_id not in in_use:
                self.remove(lora_id)

    def _read(self, request: LoRARequest) -> dict[str, list[LoRASlice]]:
        folder = Path(request.lora_path).expanduser()
        name = f"LoRA adapter {request.lora_name!r} ({folder})"
        config_path = folder / "adapter_config.json"
        weights_path = folder / "adapter_model.safetensors"
        if not config_path.is_file():
            raise ValueError(f"{name}: no adapter_config.json there.")
        if not weights_path.is_file():
            extra = (" (adapter_model.bin is not read: save the adapter as safetensors)"
                     if (folder / "adapter_model.bin").is_file() else "")
            raise ValueError(f"{name}: no adapter_model.safetensors there{extra}.")
        config = read_json_file(config_path)
        scale = self._scale(name, config)
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(weights_path))
        except Exception as e:  # a truncated or foreign file
            raise ValueError(f"{name}: adapter_model.safetensors could not be read: {e}"
                             ) from None
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            match = _KEY.match(key)
            if match is None:
                raise ValueError(f"{name}: tensor {key} is not a LoRA A or B weight "
                                 "(embedding adapters, DoRA and saved modules are not "
                                 "supported).")
            pairs.setdefault(match["module"], {})[match["part"]] = tensor
        if not pairs:
            raise ValueError(f"{name}: the adapter holds no weights.")
        slices: dict[str, list[LoRASlice]] = {}
        for module_name, pair in sorted(pairs.items()):
            target, part = self._place(name, module_name, pair, scale)
            slices.setdefault(target, []).append(part)
        return slices

    def _scale(self, name: str, config: dict[str, Any]) -> float:
        if config.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"{name}: peft_type {config.get('peft_type')!r} is not LORA.")
        for key, refused in (("use_dora", True), ("fan_in_fan_out", True)):
            if config.get(key) == refused:
                raise ValueError(f"{name}: {key} is not supported.")
        if config.get("bias", "none") != "none":
            raise ValueError(f"{name}: bias {config['bias']!r} is not supported (only none).")
        if config.get("modules_to_save"):
            raise ValueError(f"{name}: modules_to_save is not supported.")
        rank, alpha = config.get("r"), config.get("lora_alpha")
        if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
            raise ValueError(f"{name}: adapter_config.json needs an integer r and a "
                             "lora_alpha.")
        if rank > self.max_lora_rank:
            raise ValueError(f"{name}: its rank {rank} is larger than --max-lora-rank "
                             f"{self.max_lora_rank}.")
        return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank

    def _place(self, name: str, module_name: str, pair: dict[str, torch.Tensor],
               scale: float) -> tuple[str, LoRASlice]:
        """The rvllm layer ``module_name``'s A and B go into, and their slice (B times
        ``scale``)."""
        leaf = module_name.rsplit(".", 1)[-1]
        if leaf not in SUPPORTED_MODULES:
            raise ValueError(f"{name}: module {module_name} is not one rvllm adapts (only "
                             f"{', '.join(SUPPORTED_MODULES)}).")
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{name}: module {module_name} lacks its lora_A or lora_B.")
        target, shard = stacked_target(module_name + ".weight",
                                       getattr(self.model, "stacked_params", ()))
        target = target.removesuffix(".weight")
        try:
            layer = self.model.get_submodule(target)
        except AttributeError:
            raise ValueError(f"{name}: module {module_name} has no place in this "
                             "model.") from None
        if not hasattr(layer, "lora_weights"):
            raise ValueError(f"{name}: module {module_name} is not a linear layer rvllm "
                             "adapts.")
        start, size = _output_rows(layer, shard)
        inputs = getattr(layer, "input_size", None) or layer.input_size_per_partition
        a, b = pair["A"], pair["B"]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != inputs or b.shape != (size, rank):
            raise ValueError(f"{name}: module {module_name}'s lora_A {tuple(a.shape)} and "
                             f"lora_B {tuple(b.shape)} do not fit its {inputs} inputs and "
                             f"{size} outputs.")
        return target, LoRASlice(start, size, a.to(self.device, self.dtype).contiguous(),
                                 (b.float() * scale).to(self.device, self.dtype).contiguous())


def _output_rows(layer: nn.Module, shard: int | str | None) -> tuple[int, int]:
    """Where a checkpoint module's outputs lie in the layer holding it (a fused one's
    part)."""
    if shard is not None:
        rows = layer._rows(shard)
        return rows[0], rows[1]
    size = getattr(layer, "output_size_per_partition", None)
    return 0, size if size is not None else layer.output_size
