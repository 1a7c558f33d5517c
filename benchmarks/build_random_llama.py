#!/usr/bin/env python3
"""Build the benchmarks' second workload: a ~125M-parameter Llama with random weights.

Shape: hidden 768, 12 layers, 12 heads, 4 KV heads, intermediate 2048, vocab 32000, with a
byte-level BPE tokenizer trained here on local Python sources (the standard library), so
nothing comes from a model hub. Writes a Hugging Face directory (config.json, float32
safetensors, tokenizer files); scripts/bench_peers.sh converts it to GGUF for llama.cpp.

    python benchmarks/build_random_llama.py OUT_DIR [--seed 0]
"""

from __future__ import annotations

import argparse
import sysconfig
from collections.abc import Iterator
from pathlib import Path

SHAPE = dict(vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=4, intermediate_size=2048, max_position_embeddings=2048)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]


def python_sources(limit_bytes: int = 40 << 20) -> Iterator[str]:
    """Text of the standard library's .py files, up to ``limit_bytes`` in all."""
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        total += len(text)
        yield text
        if total > limit_bytes:
            return


def build_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=SHAPE["vocab_size"], special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(python_sources(), trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                 unk_token="<unk>")
    hf.save_pretrained(out_dir)


def build_model(out_dir: Path, seed: int) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPE, rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(args.out_dir)
    params = build_model(args.out_dir, args.seed)
    print(f"random Llama with {params / 1e6:.1f}M parameters in {args.out_dir}")


if __name__ == "__main__":
    main()
