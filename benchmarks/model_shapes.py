"""The model options the GPU benchmarks share: a checkpoint (``--model``) or random weights
in a known shape (``--shape qwen2.5-7b``, ``load_format="dummy"``), written as a config
in a temporary directory; ``--layers`` cuts the shape short for a quick check."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

QWEN_7B = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=3584,
               num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768,
               rms_norm_eps=1e-6, rope_theta=1000000.0, hidden_act="silu",
               tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=0,
               eos_token_id=1, use_sliding_window=False)
SHAPES = {"qwen2.5-7b": QWEN_7B}


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a checkpoint (default: the built-in model)")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="random weights of this shape instead of --model")
    p.add_argument("--layers", type=int, default=None,
                   help="with --shape: this many layers (a quick check), not the shape's")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--engine-kwargs", default="{}", help="JSON, passed to LLM(...)")


def model_and_kwargs(a: argparse.Namespace) -> tuple[str | None, dict[str, Any]]:
    """The model to pass to ``LLM`` and its keyword arguments, from ``add_model_args``'s
    options."""
    kwargs = {"device": a.device, "dtype": a.dtype, **json.loads(a.engine_kwargs)}
    if a.shape is None:
        return a.model, kwargs
    model = tempfile.mkdtemp(prefix="rvllm-shape-")
    shape = SHAPES[a.shape]
    config = dict(shape, num_hidden_layers=a.layers or shape["num_hidden_layers"])
    (Path(model) / "config.json").write_text(json.dumps(config))
    kwargs.update(load_format="dummy", skip_tokenizer_init=True)
    return model, kwargs
