#!/usr/bin/env python3
"""What a LoRA adapter costs the offline engine on the CPU.

Writes a random PEFT adapter for the built-in SmolLM2-135M-Instruct (rank ``--rank`` on
the q, k, v, o, gate, up and down projections of its first ``--layers`` layers; all 30
by default) to a temporary folder, then decodes 128 greedy tokens (EOS ignored) from one
prompt at N=1 and N=8 with and without the adapter, in one engine
(``enable_lora=True``). Each configuration runs once to warm up, then twice; the better
tok/s of the two is printed.

    python benchmarks/bench_lora.py [--rank 16] [--layers 30]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from rvllm import LLM, SamplingParams
from rvllm.lora.request import LoRARequest

# SmolLM2-135M: hidden 576, intermediate 1536, 30 layers, 9 heads (3 KV heads) of 64.
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 30, 9, 3, 64
SHAPES = {"q_proj": (HIDDEN, HEADS * HEAD_DIM), "k_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
          "v_proj": (HIDDEN, KV_HEADS * HEAD_DIM), "o_proj": (HEADS * HEAD_DIM, HIDDEN),
          "gate_proj": (HIDDEN, INTERMEDIATE), "up_proj": (HIDDEN, INTERMEDIATE),
          "down_proj": (INTERMEDIATE, HIDDEN)}
PROMPT = "Tell me a long story about a dragon and a knight who"


def write_adapter(folder: Path, rank: int, layers: int) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(layers):
        for name, (inputs, outputs) in SHAPES.items():
            block = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{i}.{block}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inputs, generator=g) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(outputs, rank, generator=g) * 0.01
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank,
                                                            "lora_alpha": 2 * rank}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--layers", type=int, default=LAYERS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        write_adapter(Path(tmp), args.rank, args.layers)
        llm = LLM(enable_lora=True, max_lora_rank=max(16, args.rank))
        lora = LoRARequest("bench", 1, tmp)
        params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
        for n in (1, 8):
            for name, request in (("base", None), ("lora", lora)):
                llm.generate([PROMPT] * n, params, lora_request=request)  # warm up
                best = 0.0
                for _ in range(2):
                    start = time.perf_counter()
                    llm.generate([PROMPT] * n, params, lora_request=request)
                    best = max(best, n * 128 / (time.perf_counter() - start))
                print(f"N={n} {name}: {best:.0f} tok/s")


if __name__ == "__main__":
    main()
