"""The model's own sampling defaults (vLLM's ``--generation-config`` and
``--override-generation-config``).

A Hugging Face checkpoint's ``generation_config.json`` carries the sampling its makers
recommend (Qwen2.5-Instruct's: temperature 0.7, top_p 0.8, top_k 20, repetition_penalty
1.05). As in vLLM, those become the defaults of every request that does not set them,
over HTTP and for ``LLM.generate`` without sampling parameters
(``LLM.get_default_sampling_params``); its ``max_new_tokens`` caps every request's
``max_tokens``. ``do_sample`` is not read (vLLM does not either). A GGUF file carries
none.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rvllm.json_options import json_options, read_json_file
from rvllm.sampling_params import SamplingParams

logger = logging.getLogger("rvllm")

# The generation-config keys that become request defaults (max_new_tokens: max_tokens).
SAMPLING_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")
OVERRIDE_KEYS = (*SAMPLING_KEYS, "max_new_tokens")


def parse_override(value: dict[str, Any] | str | None) -> dict[str, Any] | None:
    """``--override-generation-config``: a JSON object (text or dict) of OVERRIDE_KEYS;
    ValueError names what is wrong."""
    if value is None:
        return None
    return json_options(value, "override_generation_config", OVERRIDE_KEYS)


def sampling_defaults(model_path: str, generation_config: str = "auto",
                      override: dict[str, Any] | None = None) -> dict[str, Any]:
    """SamplingParams fields and values that requests default to: from the model
    directory's ``generation_config.json`` (``generation_config`` "auto"), a folder's
    (a path), or none ("vllm"), then ``override`` on top. ValueError where the folder
    has no such file or a value is out of range."""
    values: dict[str, Any] = {}
    if generation_config == "auto":
        path = Path(model_path) / "generation_config.json"
        if path.is_file():
            values = read_json_file(path)
    elif generation_config != "vllm":
        path = Path(generation_config).expanduser() / "generation_config.json"
        if not path.is_file():
            raise ValueError(f"generation_config {generation_config!r}: no "
                             "generation_config.json there (give a folder with one, "
                             "'auto' for the model's own, or 'vllm' for none).")
        values = read_json_file(path)
    values.update(override or {})
    defaults = {k: values[k] for k in SAMPLING_KEYS if values.get(k) is not None}
    if values.get("max_new_tokens") is not None:
        defaults["max_tokens"] = values["max_new_tokens"]
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the generation config's sampling defaults are unusable: {e}"
                         ) from None
    return defaults


def log_defaults(defaults: dict[str, Any]) -> None:
    if defaults:
        logger.info("requests default to the model's generation config: %s (start with "
                    "--generation-config vllm to leave it out)", defaults)

