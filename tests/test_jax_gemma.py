"""Gemma 3 and 4 under the JAX backend: their sliding and global layers scanned as pattern
blocks (Gemma 4's KV-sharing layers as stacks of their own) generate what transformers
generates in float32, however the engine batches and chunks; and the step's layouts
(pattern blocks, one flat scan, unrolled layers) agree."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import build_tokenizer, hf_greedy

from rvllm import LLM, SamplingParams

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                                 reason="the jax extra is not installed")]

NEW_TOKENS = 12
PROMPT_LENS = (1, 3, 7, 16, 17, 31, 48, 70)  # several past the 16-token window
# Two sequences a step at most: 8 step shapes to compile (tokens 8, 16, 32 by sequences 1
# and 2, and decodes alone of 1 and 2).
ENGINE = dict(model_impl="jax", block_size=8, max_model_len=128, max_num_batched_tokens=32,
              max_num_seqs=2)
SLIDING, GLOBAL = "sliding_attention", "full_attention"


def build_gemma3(out_dir: Path, num_layers: int, pattern: tuple[str, ...]) -> Path:
    """A tiny random Gemma 3 whose layers repeat ``pattern``, with random norm weights (so
    the (1 + w) norms cannot hide behind w = 0), a query scale apart from head_dim, local
    and global RoPE of their own bases (the global one linearly scaled) and a final
    logit soft-cap."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "gemma3_text", architectures=["Gemma3ForCausalLM"], vocab_size=512, hidden_size=64,
        intermediate_size=128, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
        initializer_range=0.1, bos_token_id=0, eos_token_id=2, pad_token_id=0,
        query_pre_attn_scalar=24, sliding_window=16, final_logit_softcapping=3.0,
        layer_types=[pattern[i % len(pattern)] for i in range(num_layers)],
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 100.0},
                         GLOBAL: {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    build_tokenizer(out_dir)
    return out_dir


def build_gemma4(out_dir: Path) -> Path:
    """A tiny random Gemma 4 of 8 layers (sliding, global) x 4 with every dense option:
    global layers of another head size and KV heads taking their values from the keys,
    the last 4 layers reading the caches of layers 2 and 3 with double-wide MLPs,
    per-layer inputs, random layer scales and a final logit soft-cap."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "gemma4_text", architectures=["Gemma4ForCausalLM"], vocab_size=512, hidden_size=64,
        intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, max_position_embeddings=256, rms_norm_eps=1e-6,
        initializer_range=0.1, bos_token_id=0, eos_token_id=2, pad_token_id=0,
        sliding_window=16, layer_types=[SLIDING, GLOBAL] * 4, num_kv_shared_layers=4,
        hidden_size_per_layer_input=16, vocab_size_per_layer_input=512,
        use_double_wide_mlp=True, final_logit_softcapping=5.0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    model.save_pretrained(out_dir)
    build_tokenizer(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def gemma4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma4(tmp_path_factory.mktemp("models") / "gemma4")


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Two whole blocks of (sliding, sliding, global) scanned, two sliding layers left over.
    return build_gemma3(tmp_path_factory.mktemp("models") / "gemma3", 8,
                        (SLIDING, SLIDING, GLOBAL))


def make_prompts(seed: int, lens: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 400, (n,), generator=g).tolist() for n in lens]


def test_gemma3_pattern_blocks_match_transformers(gemma3_dir: Path) -> None:
    llm = LLM(str(gemma3_dir), num_gpu_blocks=64, **ENGINE)
    blocks, leftovers = llm.engine.runner.spec.stacks
    assert (blocks.first, blocks.repeats, [k.rope for k in blocks.pattern]) == (
        0, 2, ["local", "local", "global"])
    assert [k.window for k in blocks.pattern][:2] == [16, 16]
    assert (leftovers.first, leftovers.repeats, len(leftovers.pattern)) == (6, 1, 2)
    # A mixed batch: the 48- and 70-token prompts are prefilled in chunks beside the
    # others' decodes.
    prompts = make_prompts(1, PROMPT_LENS)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(gemma3_dir, prompts, NEW_TOKENS)


def test_gemma4_kv_sharing_and_global_geometry_match_transformers(gemma4_dir: Path) -> None:
    # Tokens 8 and 16 by sequences 1 and 2: 6 step shapes.
    llm = LLM(str(gemma4_dir), num_gpu_blocks=64, **{**ENGINE, "max_num_batched_tokens": 16})
    runner = llm.engine.runner
    own, shared = runner.spec.stacks
    assert (own.repeats, [(k.head_dim, k.num_kv_heads) for k in own.pattern]) == (
        2, [(16, 2), (32, 1)])
    # The sharing layers read the last sliding and global layers before them (2 and 3)
    # and have no cache of their own.
    assert (shared.first, [k.kv_source for k in shared.pattern]) == (4, [(0, 0, 1), (0, 1, 1)])
    assert runner.caches[1] == [{}, {}]
    prompts = make_prompts(1, PROMPT_LENS)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(gemma4_dir, prompts, NEW_TOKENS)


def test_gemma4_moe_is_refused(gemma4_dir: Path) -> None:
    from rvllm.config import ModelConfig
    from rvllm.jax.weights import check_supported

    config = ModelConfig(str(gemma4_dir), {"enable_moe_block": True}, "Gemma4ForCausalLM",
                         torch.float32, 128)
    with pytest.raises(ValueError, match="MoE block"):
        check_supported(config)


def _runner(model_dir: Path, layout: str) -> Any:
    from rvllm.config import ModelConfig, SchedulerConfig
    from rvllm.jax.runner import JaxModelRunner

    config = ModelConfig.from_path(str(model_dir), torch.float32, 128)
    runner = JaxModelRunner(config, SchedulerConfig(4, 32), 8, torch.device("cpu"),
                            layout=layout)
    runner.allocate_kv_cache(32, 2, 16, torch.float32, compile_buckets=False)
    return runner


def _two_steps(runner: Any) -> list[np.ndarray]:
    """Every row's logits of two steps: a 24-token chunk of a 30-token prompt beside a
    whole 8-token prompt, then the first's last 6 tokens beside the second's decode."""
    a, b = make_prompts(3, (30, 9))
    logits = []
    for chunks in (((0, 24), (0, 8)), ((24, 30), (8, 9))):
        ids, pos, slots, query_start, seq_lens, tables, rows = runner._padding(32, 2, 32)
        start = 0
        for i, (prompt, (lo, hi)) in enumerate(zip((a, b), chunks)):
            table = np.arange(4, dtype=np.int32) + 4 * i
            ids[start:start + hi - lo] = prompt[lo:hi]
            pos[start:start + hi - lo] = np.arange(lo, hi)
            slots[start:start + hi - lo] = table[np.arange(lo, hi) // 8] * 8 + np.arange(lo, hi) % 8
            tables[i, :4] = table
            seq_lens[i] = hi
            start += hi - lo
            query_start[i + 1] = start
        rows[:] = np.arange(32)
        logits.append(np.asarray(runner._run(ids, pos, slots, query_start, seq_lens, tables,
                                             rows))[:start])
    return logits


def test_scanned_flat_and_unrolled_layers_agree(gemma3_dir: Path, gemma4_dir: Path) -> None:
    for model_dir, layouts in ((gemma3_dir, ("blocks", "flat", "unrolled")),
                               (gemma4_dir, ("blocks", "unrolled"))):
        results = [_two_steps(_runner(model_dir, layout)) for layout in layouts]
        for other in results[1:]:
            for got, expected in zip(other, results[0]):
                np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def _lowered_ops(model_dir: Path, layout: str) -> int:
    from rvllm.jax.model import jitted_step

    runner = _runner(model_dir, layout)
    text = jitted_step.lower(*runner.step_args(8, 1), spec=runner.spec).as_text()
    return text.count("\n")


def test_the_scanned_step_does_not_grow_with_layers(gemma3_dir: Path,
                                                    tmp_path_factory: pytest.TempPathFactory
                                                    ) -> None:
    # 8 and 26 layers of the same pattern: 2 and 8 repeats of the block, 2 layers left
    # over. The scanned step's program is the same size; the unrolled one's grows.
    deep = build_gemma3(tmp_path_factory.mktemp("models") / "gemma3-26", 26,
                        (SLIDING, SLIDING, GLOBAL))
    scanned = [_lowered_ops(d, "blocks") for d in (gemma3_dir, deep)]
    unrolled = [_lowered_ops(d, "unrolled") for d in (gemma3_dir, deep)]
    assert scanned[0] == scanned[1]
    assert unrolled[1] > 2.5 * unrolled[0] and unrolled[0] > scanned[0]
