"""The in-run peer: transformers ``generate`` on a Qwen2.5-7B-shaped model with random
weights (bf16, greedy, fixed-length outputs), the baseline the engine benchmark is
read against.

    python benchmarks/bench_hf_peer.py --out hf_peer.json
    python benchmarks/bench_hf_peer.py --save-config DIR    # write the model's config.json only
    python benchmarks/bench_hf_peer.py --quick              # tiny model on CPU (smoke run)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
    "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "use_sliding_window": False,
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
}
TINY = {**QWEN25_7B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
        "bos_token_id": 1, "eos_token_id": 2}


def build_model(config: dict, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters made directly in bf16 on the device
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(Qwen2Config(**config))
    finally:
        torch.set_default_dtype(previous)
    return model.to(device=device, dtype=dtype).eval()


def tokens_per_second(model: torch.nn.Module, batch: int, prompt_len: int, output_len: int,
                      vocab: int) -> dict:
    device = next(model.parameters()).device
    ids = torch.randint(10, vocab, (batch, prompt_len), device=device)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                  max_new_tokens=output_len, min_new_tokens=output_len)
    model.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, **kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    generated = (out.shape[1] - prompt_len) * batch
    return {"num_seqs": batch, "prompt_len": prompt_len, "output_len": output_len,
            "seconds": round(seconds, 3), "output_tok_s": round(generated / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--save-config", type=Path, help="write config.json here and exit")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    args = parser.parse_args()
    config = TINY if args.quick else QWEN25_7B
    if args.save_config:
        args.save_config.mkdir(parents=True, exist_ok=True)
        (args.save_config / "config.json").write_text(json.dumps(config, indent=1))
        return
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    start = time.perf_counter()
    model = build_model(config, device, dtype)
    name = "tiny Qwen2-shaped" if args.quick else "Qwen2.5-7B-shaped"
    result = {"peer": "transformers.generate", "model": f"{name}, random weights",
              "dtype": str(dtype), "load_s": round(time.perf_counter() - start, 2), "runs": []}
    import transformers

    result["transformers"] = transformers.__version__
    with torch.inference_mode():
        for batch in map(int, args.batches.split(",")):
            run = tokens_per_second(model, batch, args.prompt_len, args.output_len,
                                    config["vocab_size"])
            print(json.dumps(run), flush=True)
            result["runs"].append(run)
            if args.out:  # partial results survive a timeout
                args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
