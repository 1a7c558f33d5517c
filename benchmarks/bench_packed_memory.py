#!/usr/bin/env python3
"""Memory and one-sequence decode of a 7B-shaped Q4_K_M GGUF kept packed on the CPU.

Writes a Llama-2-7B-shaped GGUF (hidden 4096, 32 layers, 32 heads, intermediate 11008,
vocabulary 32000) with random blocks laid out as llama.cpp's Q4_K_M lays out its types
(Q4_K, with V and down in Q6_K in the layers its rule picks, and a Q6_K output), loads it
with rvllm (``--quantization gguf``, the default for such a file) in a process of its
own, and reports the engine's resident memory after load against the file's bytes plus
the KV cache, then the decode rate of one sequence over 16 tokens. With ``--llama-bench``
it runs llama.cpp's ``llama-bench -p 0 -n 16`` on the same file, same threads.

    python benchmarks/bench_packed_memory.py [--gguf /tmp/llama2-7b-q4km.gguf]
        [--llama-bench PATH] [--json OUT]

The weights are random (one random tensor per type and shape, reused by every layer), so
only the memory and the speed mean anything, not the text.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SHAPE = dict(hidden=4096, inter=11008, layers=32, heads=32, kv_heads=32, vocab=32000)


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's rule for which layers' V and down projections Q4_K_M keeps in Q6_K:
    the first and last eighth, and every third layer between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def write_gguf(path: Path) -> None:
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as T

    s = SHAPE
    rng = np.random.default_rng(0)
    cache: dict[tuple, np.ndarray] = {}

    def blocks(fmt: int, n: int, k: int) -> np.ndarray:
        if (fmt, n, k) not in cache:
            block, size = gguf.GGML_QUANT_SIZES[fmt]
            data = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
            halves = [(208, 210)] if fmt == T.Q6_K else [(0, 2), (2, 4)]
            for a, b in halves:
                d = (rng.standard_normal((n, k // block, 1)) * 1e-3).astype(np.float16)
                data[..., a:b] = d.view(np.uint8)
            cache[(fmt, n, k)] = data.reshape(n, -1)
        return cache[(fmt, n, k)]

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(s["layers"])
    writer.add_context_length(4096)
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["inter"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(s["hidden"] // s["heads"])
    writer.add_vocab_size(s["vocab"])
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tokens += [f"\u2581t{i}" for i in range(s["vocab"] - len(tokens))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([2, 3, 3, *[6] * 256, *[1] * (len(tokens) - 259)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def add(name: str, fmt: int, n: int, k: int) -> None:
        data = blocks(fmt, n, k)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=fmt)

    h, inter, kv = s["hidden"], s["inter"], s["kv_heads"] * (s["hidden"] // s["heads"])
    add("token_embd.weight", T.Q4_K, s["vocab"], h)
    writer.add_tensor("output_norm.weight", np.ones(h, np.float32))
    add("output.weight", T.Q6_K, s["vocab"], h)
    for i in range(s["layers"]):
        more = T.Q6_K if _more_bits(i, s["layers"]) else T.Q4_K
        add(f"blk.{i}.attn_q.weight", T.Q4_K, h, h)
        add(f"blk.{i}.attn_k.weight", T.Q4_K, kv, h)
        add(f"blk.{i}.attn_v.weight", more, kv, h)
        add(f"blk.{i}.attn_output.weight", T.Q4_K, h, h)
        add(f"blk.{i}.ffn_gate.weight", T.Q4_K, inter, h)
        add(f"blk.{i}.ffn_up.weight", T.Q4_K, inter, h)
        add(f"blk.{i}.ffn_down.weight", more, h, inter)
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(h, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(h, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def run_engine(path: str, tokens: int) -> dict:
    """In this process: load the file, measure, decode ``tokens`` tokens of one sequence."""
    from rvllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(path, max_model_len=128, kv_cache_memory=0.25)
    load_s = time.perf_counter() - start
    engine = llm.engine
    kv_bytes = engine.runner.kv_cache_block_bytes() * engine.block_manager.num_blocks
    rss = _rss_bytes()
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([[1, 300, 301]], SamplingParams(temperature=0, max_tokens=2))  # warm
    start = time.perf_counter()
    out = llm.generate([[1, 400, 401, 402]], params)
    seconds = time.perf_counter() - start
    assert len(out[0].outputs[0].token_ids) == tokens
    return {"quantization": engine.quantization, "linear_backend": engine.model.linear_backend,
            "load_s": round(load_s, 1), "rss_after_load_bytes": rss,
            "kv_cache_bytes": kv_bytes, "decode_tok_s_n1": round(tokens / seconds, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default="/tmp/llama2-7b-q4km.gguf")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--llama-bench", default=None, help="path of llama.cpp's llama-bench")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--json", default=None)
    parser.add_argument("--engine-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_only:
        print(json.dumps(run_engine(args.gguf, args.tokens)))
        return 0
    path = Path(args.gguf)
    if not path.exists():
        start = time.perf_counter()
        write_gguf(path)
        print(f"wrote {path} in {time.perf_counter() - start:.0f}s", file=sys.stderr)
    from rvllm.models.gguf_file import open_gguf

    tensor_bytes = sum(t.nbytes for t in open_gguf(path).tensors.values())
    out = subprocess.run([sys.executable, __file__, "--engine-only", "--gguf", str(path),
                          "--tokens", str(args.tokens)], capture_output=True, text=True,
                         check=True)
    rvllm = json.loads(out.stdout.strip().splitlines()[-1])
    budget = 1.25 * tensor_bytes + rvllm["kv_cache_bytes"]
    result = {"benchmark": "packed_memory", "model": str(path), "shape": SHAPE,
              "file_bytes": path.stat().st_size, "tensor_bytes": tensor_bytes,
              "rvllm": rvllm, "rss_over_file_plus_kv": round(
                  rvllm["rss_after_load_bytes"] / (tensor_bytes + rvllm["kv_cache_bytes"]), 3),
              "within_1_25x": rvllm["rss_after_load_bytes"] <= budget}
    if args.llama_bench:
        env = dict(os.environ, LD_LIBRARY_PATH=str(Path(args.llama_bench).parent))
        bench = subprocess.run([args.llama_bench, "-m", str(path), "-p", "0", "-n",
                                str(args.tokens), "-t", str(args.threads), "-o", "json"],
                               capture_output=True, text=True, check=True, env=env)
        rows = json.loads(bench.stdout)
        result["llama_cpp_decode_tok_s_n1"] = round(rows[0]["avg_ts"], 2)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
