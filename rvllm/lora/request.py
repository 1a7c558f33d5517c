"""Which adapter a request runs with, as vLLM names it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter: ``lora_name`` (what the API's ``model`` field names), ``lora_int_id``
    (a positive id, one per adapter) and ``lora_path`` (a PEFT folder:
    ``adapter_config.json`` and ``adapter_model.safetensors``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got "
                             f"{self.lora_int_id!r}.")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty.")


def parse_lora_modules(values: list[str] | None) -> list[LoRARequest]:
    """``--lora-modules``: each ``name=path`` (or vLLM's JSON form, ``{"name": ...,
    "path": ...}``), numbered from 1 in order. ValueError names a bad one."""
    import json

    modules: list[LoRARequest] = []
    for value in values or []:
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
                name, path = spec["name"], spec["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules {value!r}: give name=path, or JSON with "
                                 "\"name\" and \"path\".") from None
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {value!r}: give name=path.")
        if any(m.lora_name == name for m in modules):
            raise ValueError(f"--lora-modules names {name!r} twice.")
        modules.append(LoRARequest(name, len(modules) + 1, path))
    return modules
