"""Gemma 1 to 4 under the JAX backend: their sliding and global layers scanned as pattern
blocks (Gemma 4's KV-sharing layers as stacks of their own; Gemma 2's scores and logits
soft-capped) generate what transformers generates in float32, however the engine batches
and chunks; and the step's layouts (pattern blocks, one flat scan, unrolled layers)
agree."""

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


def _random_model(config: Any) -> Any:
    """A float32 model of ``config`` from seed 0, its norm weights made random (a
    (1 + w) norm starts at w = 0, which would hide a norm applied the wrong way)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


def build_gemma3(out_dir: Path, num_layers: int, pattern: tuple[str, ...]) -> Path:
    """A tiny random Gemma 3 whose layers repeat ``pattern``, with random norm weights (so
    the (1 + w) norms cannot hide behind w = 0), a query scale apart from head_dim, local
    and global RoPE of their own bases (the global one linearly scaled) and a final
    logit soft-cap."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "gemma3_text", architectures=["Gemma3ForCausalLM"], vocab_size=512, hidden_size=64,
        intermediate_size=128, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
        initializer_range=0.1, bos_token_id=0, eos_token_id=2, pad_token_id=0,
        query_pre_attn_scalar=24, sliding_window=16, final_logit_softcapping=3.0,
        layer_types=[pattern[i % len(pattern)] for i in range(num_layers)],
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 100.0},
                         GLOBAL: {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}})
    model = _random_model(config)
    model.save_pretrained(out_dir)
    build_tokenizer(out_dir)
    return out_dir


def build_gemma4(out_dir: Path) -> Path:
    """A tiny random Gemma 4 of 8 layers (sliding, global) x 4 with every dense option:
    global layers of another head size and KV heads taking their values from the keys,
    the last 4 layers reading the caches of layers 2 and 3 with double-wide MLPs,
    per-layer inputs, random layer scales and a final logit soft-cap."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "gemma4_text", architectures=["Gemma4ForCausalLM"], vocab_size=512, hidden_size=64,
        intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, max_position_embeddings=256, rms_norm_eps=1e-6,
        initializer_range=0.1, bos_token_id=0, eos_token_id=2, pad_token_id=0,
        sliding_window=16, layer_types=[SLIDING, GLOBAL] * 4, num_kv_shared_layers=4,
        hidden_size_per_layer_input=16, vocab_size_per_layer_input=512,
        use_double_wide_mlp=True, final_logit_softcapping=5.0)
    model = _random_model(config)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    model.save_pretrained(out_dir)
    build_tokenizer(out_dir)
    return out_dir


def build_gemma2(out_dir: Path, num_layers: int = 5, attn_cap: float = 5.0,
                 final_cap: float = 3.0) -> Path:
    """A tiny random Gemma 2 of alternating sliding and global layers (two whole blocks
    and a sliding layer left over), with random norm weights, a query scale apart from
    head_dim, a 16-token window and soft-caps low enough to change its scores and logits
    (``test_gemma2_soft_caps_bite`` checks they do): its query weights scaled up so that
    scores reach the attention cap."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "gemma2", architectures=["Gemma2ForCausalLM"], vocab_size=512, hidden_size=64,
        intermediate_size=128, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
        initializer_range=0.1, bos_token_id=0, eos_token_id=2, pad_token_id=0,
        query_pre_attn_scalar=24, sliding_window=16, attn_logit_softcapping=attn_cap,
        final_logit_softcapping=final_cap,
        layer_types=[(SLIDING, GLOBAL)[i % 2] for i in range(num_layers)],
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    model = _random_model(config)
    with torch.no_grad():  # scores large enough for the cap to matter
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(3.0)
    model.save_pretrained(out_dir)
    build_tokenizer(out_dir)
    return out_dir


def build_gemma1(out_dir: Path) -> Path:
    """A tiny random Gemma 1 of 4 layers: two norms a layer, a head size apart from
    hidden / heads, random norm weights."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "gemma", architectures=["GemmaForCausalLM"], vocab_size=512, hidden_size=64,
        intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=256, rms_norm_eps=1e-6,
        initializer_range=0.1, bos_token_id=0, eos_token_id=2, pad_token_id=0,
        hidden_act="gelu_pytorch_tanh", rope_parameters={"rope_type": "default",
                                                         "rope_theta": 1000.0})
    model = _random_model(config)
    model.save_pretrained(out_dir)
    build_tokenizer(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma2(tmp_path_factory.mktemp("models") / "gemma2")


@pytest.fixture(scope="module")
def gemma1_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma1(tmp_path_factory.mktemp("models") / "gemma1")


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


def test_gemma2_soft_caps_and_windows_match_transformers(gemma2_dir: Path) -> None:
    from rvllm.jax.weights import NO_WINDOW

    llm = LLM(str(gemma2_dir), num_gpu_blocks=64, **ENGINE)
    spec = llm.engine.runner.spec
    assert (spec.family, spec.attn_softcap, spec.final_softcap) == ("gemma2", 5.0, 3.0)
    assert spec.attn_scale == 24 ** -0.5
    blocks, leftover = spec.stacks
    assert (blocks.repeats, [(k.window, k.rope) for k in blocks.pattern]) == (
        2, [(16, "local"), (NO_WINDOW, "global")])
    assert (leftover.first, leftover.repeats, len(leftover.pattern)) == (4, 1, 1)
    prompts = make_prompts(1, PROMPT_LENS)
    # With logprobs: the final cap never changes the argmax, but does the log-softmax.
    outs = [o.outputs[0] for o in llm.generate(prompts, SamplingParams(
        temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1))]
    assert [o.token_ids for o in outs] == hf_greedy(gemma2_dir, prompts, NEW_TOKENS)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gemma2_dir, dtype=torch.float32)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out.token_ids[:-1]])).logits[0]
        expected = torch.log_softmax(logits[len(prompt) - 1:], -1)
        expected = expected[torch.arange(NEW_TOKENS), out.token_ids].numpy()
        got = [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def test_gemma2_soft_caps_bite(gemma2_dir: Path) -> None:
    """The caps the tests run under change transformers' scores and logits: without them
    the greedy tokens differ."""
    from transformers import AutoModelForCausalLM

    prompts = make_prompts(1, PROMPT_LENS[-2:])
    model = AutoModelForCausalLM.from_pretrained(gemma2_dir, dtype=torch.float32)
    with torch.no_grad():
        capped = [model(torch.tensor([p])).logits[0] for p in prompts]
        model.config.final_logit_softcapping = None
        uncapped_final = [model(torch.tensor([p])).logits[0] for p in prompts]
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped = [model(torch.tensor([p])).logits[0] for p in prompts]
    assert max(float(c.abs().max()) for c in capped) < 3.0
    assert max(float(u.abs().max()) for u in uncapped_final) > 3.0
    # The attention cap alone changes the logits well past float32 rounding.
    assert max(float((u - f).abs().max()) for u, f in zip(uncapped, uncapped_final)) > 0.1


def test_gemma1_matches_transformers(gemma1_dir: Path) -> None:
    from rvllm.jax.weights import NO_WINDOW

    llm = LLM(str(gemma1_dir), num_gpu_blocks=64, **ENGINE)
    spec = llm.engine.runner.spec
    assert (spec.family, spec.attn_softcap, spec.final_softcap) == ("gemma1", None, None)
    (stack,) = spec.stacks
    assert (stack.repeats, [(k.head_dim, k.window) for k in stack.pattern]) == (
        4, [(24, NO_WINDOW)])
    prompts = make_prompts(2, PROMPT_LENS)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(gemma1_dir, prompts, NEW_TOKENS)


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


def test_scanned_flat_and_unrolled_layers_agree(gemma3_dir: Path, gemma4_dir: Path,
                                                gemma2_dir: Path) -> None:
    for model_dir, layouts in ((gemma3_dir, ("blocks", "flat", "unrolled")),
                               (gemma4_dir, ("blocks", "unrolled")),
                               (gemma2_dir, ("blocks", "flat"))):
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
