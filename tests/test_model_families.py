"""Every supported model family generates exactly what transformers generates, however the
engine batches: whole prompts, chunked prefill, and under preemption."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import build_tokenizer, hf_greedy

from rvllm import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 12
PROMPT_LENS = (1, 5, 13, 22, 37, 70)  # several longer than the sliding windows below
WINDOW = 16

BASE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=0, eos_token_id=2, pad_token_id=0,
)

# family -> (config overrides, seed[, LLM arguments]). Every family is built in float32 with
# random norm weights, scales and biases, so the (1 + w) and plain RMSNorm conventions cannot
# hide behind w = 1 or 0, nor a missing bias or scale behind its constant initial value.
FAMILIES: dict[str, tuple] = {
    "qwen3": (dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=16,
                   use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1), 0),
    # Qwen2 slides only from max_window_layers on, and only under use_sliding_window.
    "qwen2_sliding": (dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                           use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
                      0),
    # YaRN on a Llama-shaped model, as Qwen2.5 and Qwen3 are told to extend their context.
    "qwen2_yarn": (dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                        rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                      "original_max_position_embeddings": 64}), 0),
    # attention_bias puts a bias on o_proj too (unlike Qwen2's), mlp_bias on all three MLP
    # projections.
    "llama_biases": (dict(architectures=["LlamaForCausalLM"], model_type="llama",
                          attention_bias=True, mlp_bias=True), 0),
    "gemma": (dict(architectures=["GemmaForCausalLM"], model_type="gemma", head_dim=16), 0),
    "gemma2": (dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", head_dim=16,
                    query_pre_attn_scalar=24, sliding_window=WINDOW, attn_logit_softcapping=2.0,
                    final_logit_softcapping=3.0, num_hidden_layers=3), 0),
    "gemma2_no_softcaps": (dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2",
                                head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                                attn_logit_softcapping=None, final_logit_softcapping=None,
                                num_hidden_layers=3), 0),
    "gemma3": (dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=16,
                    query_pre_attn_scalar=24, sliding_window=WINDOW, num_hidden_layers=3,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    rope_parameters={
                        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                        "full_attention": {"rope_type": "linear", "rope_theta": 10000.0,
                                           "factor": 4.0}}), 0),
    # Gemma 4 with every option on: global layers of another head size sharing K and V,
    # KV-sharing last layers, per-layer inputs, the MoE block and double-wide MLPs.
    "gemma4": (dict(architectures=["Gemma4ForCausalLM"], model_type="gemma4_text",
                    head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                    attention_k_eq_v=True, sliding_window=WINDOW, num_hidden_layers=4,
                    layer_types=["sliding_attention", "full_attention"] * 2,
                    num_kv_shared_layers=2, hidden_size_per_layer_input=16,
                    vocab_size_per_layer_input=512, enable_moe_block=True, num_experts=4,
                    top_k_experts=2, moe_intermediate_size=32, use_double_wide_mlp=True,
                    final_logit_softcapping=5.0), 0),
    # LongRoPE's short factors apply while the engine stays within the pretraining length.
    "phi3": (dict(architectures=["Phi3ForCausalLM"], model_type="phi3", sliding_window=WINDOW,
                  original_max_position_embeddings=128, partial_rotary_factor=0.75,
                  rope_scaling={"rope_type": "longrope", "rope_theta": 1000.0,
                                "short_factor": [1.0, 1.3, 1.7, 2.2, 3.0, 4.0],
                                "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]}),
             0, dict(max_model_len=128)),
    "phi": (dict(architectures=["PhiForCausalLM"], model_type="phi", partial_rotary_factor=0.5,
                 qk_layernorm=True, layer_norm_eps=1e-5, hidden_act="gelu_new"), 0),
    "mixtral": (dict(architectures=["MixtralForCausalLM"], model_type="mixtral",
                     num_local_experts=4, num_experts_per_tok=2, intermediate_size=64,
                     sliding_window=WINDOW), 0),
    "qwen3_moe": (dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                       head_dim=16, num_experts=6, num_experts_per_tok=2, norm_topk_prob=False,
                       moe_intermediate_size=32, num_hidden_layers=3, mlp_only_layers=[1]), 0),
    "deepseek_v2": (dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
                         num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32,
                         qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                         n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=1,
                         moe_intermediate_size=32, first_k_dense_replace=1,
                         topk_method="group_limited_greedy", n_group=3, topk_group=1,
                         routed_scaling_factor=1.5,
                         rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                       "original_max_position_embeddings": 64,
                                       "mscale": 0.707, "mscale_all_dim": 0.707,
                                       "beta_fast": 32, "beta_slow": 1}), 0),
    # DeepSeek-V2-Lite's shape: a plain q_proj (no query LoRA) and ungrouped routing.
    "deepseek_v2_lite": (dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
                              num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32,
                              qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                              n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=2,
                              moe_intermediate_size=32, first_k_dense_replace=1,
                              topk_method="greedy", n_group=1, topk_group=1,
                              rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 64,
                                            "mscale": 0.707, "mscale_all_dim": 0.707,
                                            "beta_fast": 32, "beta_slow": 1}), 0),
}


def build_family(name: str, out_dir: Path, spec: tuple | None = None) -> Path:
    """The family's tiny random model, or with ``spec`` (its FAMILIES-style entry) a
    variant of it tested apart."""
    from transformers import AutoConfig, AutoModelForCausalLM

    overrides, seed = (spec or FAMILIES[name])[:2]
    kwargs = {**BASE, **overrides}
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or "scale" in pname or pname.endswith(".bias"):
                p.add_(0.2 * torch.randn_like(p))
        for bname, b in model.named_buffers():
            if bname.endswith("layer_scalar"):  # Gemma 4's per-layer output scale
                b.uniform_(0.5, 1.5)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(out_dir)
    build_tokenizer(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_family(name, tmp_path_factory.mktemp(name))
        return built[name]

    return get


def make_prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 400, (n,), generator=g).tolist() for n in PROMPT_LENS]


_REFERENCE: dict[Path, list[list[int]]] = {}


def reference(model_dir: Path) -> list[list[int]]:
    if model_dir not in _REFERENCE:
        _REFERENCE[model_dir] = hf_greedy(model_dir, make_prompts(), NEW_TOKENS)
    return _REFERENCE[model_dir]


def engine(family: str, path: Path, **kwargs: Any) -> LLM:
    # Token-identical to transformers holds in float32, so pin it (a GPU default is bf16).
    family_kwargs = FAMILIES[family][2] if len(FAMILIES[family]) > 2 else {}
    return LLM(str(path), device="cpu", dtype="float32", **{**family_kwargs, **kwargs})


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(make_prompts(), params)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_batched_greedy_matches_transformers(family_dir: Callable[[str], Path],
                                             family: str) -> None:
    path = family_dir(family)
    assert greedy(engine(family, path)) == reference(path)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_chunked_prefill_matches_transformers(family_dir: Callable[[str], Path],
                                              family: str) -> None:
    path = family_dir(family)
    assert greedy(engine(family, path, max_num_batched_tokens=24)) == reference(path)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_preemption_matches_transformers(family_dir: Callable[[str], Path], family: str) -> None:
    path = family_dir(family)
    llm = engine(family, path, num_gpu_blocks=16, max_model_len=128, block_size=8)
    assert greedy(llm) == reference(path)
    assert llm.engine.scheduler.num_preemptions > 0


def test_mla_caches_only_the_compressed_latent(family_dir: Callable[[str], Path]) -> None:
    llm = engine("deepseek_v2", family_dir("deepseek_v2"), num_gpu_blocks=16,
                 max_model_len=128, block_size=8)
    kv_lora_rank, rope_dim = FAMILIES["deepseek_v2"][0]["kv_lora_rank"], 8
    caches = [attn.kv_cache for attn in llm.engine.model.attention_layers()]
    assert all(len(c) == 1 and c[0].shape == (16, 8, 1, kv_lora_rank + rope_dim)
               for c in caches)


def test_gemma4_kv_sharing_layers_allocate_no_cache(family_dir: Callable[[str], Path]) -> None:
    model = engine("gemma4", family_dir("gemma4")).engine.model
    layers = model.model.layers
    assert len(model.attention_layers()) == 2  # 4 layers, the last 2 reuse the first 2
    assert layers[2].self_attn.attn is layers[0].self_attn.attn
    assert layers[3].self_attn.attn is layers[1].self_attn.attn
    # Global layers: head_dim 32 with one KV head; sliding layers: 16 with two.
    assert [tuple(a.kv_cache[0].shape[2:]) for a in model.attention_layers()] == [(2, 16), (1, 32)]


def test_fused_moe_matches_a_per_token_loop() -> None:
    from rvllm.layers.moe import FusedMoE, select_experts

    torch.manual_seed(0)
    moe = FusedMoE(num_experts=5, hidden_size=8, intermediate_size=6)
    moe.w13_weight.normal_()
    moe.w2_weight.normal_()
    x, logits = torch.randn(11, 8), torch.randn(11, 5)
    weights, ids = select_experts(logits, top_k=2, renormalize=True)
    expected = torch.zeros_like(x)
    for t in range(11):
        for w, e in zip(weights[t], ids[t]):
            gate, up = (moe.w13_weight[e] @ x[t]).chunk(2)
            expected[t] += w * (moe.w2_weight[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(moe(x, weights, ids), expected)


LONGROPE = dict(original_max_position_embeddings=128, partial_rotary_factor=0.75,
                rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5, 2, 3, 4, 5],
                              "long_factor": [1.0, 2, 4, 8, 16, 32]})
YARN = dict(qk_rope_head_dim=8, rope_scaling={
    "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64,
    "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1})


@pytest.mark.parametrize("model_type, kwargs, dim, layer_type, max_position, seq_len", [
    ("phi3", LONGROPE, 12, None, 128, None),  # within the pretraining length: short factors
    ("phi3", LONGROPE, 12, None, 256, 129),  # beyond it: long factors
    ("deepseek_v2", YARN, 8, None, 256, None),
    ("qwen2", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": 64}), 16, None, 256, None),
    ("gemma4_text", dict(head_dim=16, global_head_dim=32), 32, "full_attention", 256, None),
])
def test_scaled_rope_frequencies_match_transformers(
    model_type: str, kwargs: dict, dim: int, layer_type: str | None, max_position: int,
    seq_len: int | None,
) -> None:
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from rvllm.layers.rotary_scaled import inv_freq_and_scale, rope_type_of

    config = AutoConfig.for_model(model_type, **{**BASE, **kwargs})
    cfg = config.to_dict()
    if layer_type is None:
        params = rope_type_of(cfg)
    else:
        params = rope_type_of({"rope_parameters": cfg["rope_parameters"][layer_type]})
    init = ROPE_INIT_FUNCTIONS[params["rope_type"]]
    expected_freq, expected_scale = init(config, None, seq_len=seq_len, layer_type=layer_type)
    inv_freq, scale = inv_freq_and_scale(dim, params, max_position, cfg["max_position_embeddings"])
    torch.testing.assert_close(inv_freq, expected_freq)
    assert scale == pytest.approx(expected_scale)


def test_longrope_past_the_pretraining_length_matches_transformers(tmp_path: Path) -> None:
    """An engine that may run past original_max_position_embeddings rotates with the long
    factors throughout; transformers switches to them once a sequence is that long, so
    prompts already past it see the long factors in both from the first token on."""
    original = 32
    overrides = {**FAMILIES["phi3"][0], "original_max_position_embeddings": original}
    path = build_family("phi3", tmp_path, (overrides, 0))
    prompts = [p for p in make_prompts() if len(p) > original]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=128)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == hf_greedy(
        path, prompts, NEW_TOKENS)


def test_longrope_in_the_transformers_4_spelling_generates_alike(
        family_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """Phi-3 configs on the hub spell LongRoPE as transformers 4 wrote it: rope_scaling
    with "type", rope_theta and original_max_position_embeddings at the top level."""
    path = family_dir("phi3")
    legacy = shutil.copytree(path, tmp_path / "phi3")
    cfg = json.loads((legacy / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope["rope_theta"]
    cfg["rope_scaling"] = {"type": "longrope", "long_factor": rope["long_factor"],
                           "short_factor": rope["short_factor"]}
    (legacy / "config.json").write_text(json.dumps(cfg))
    assert greedy(engine("phi3", legacy)) == reference(path)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bfloat16_kv_cache_agrees_across_kernel_backends(family_dir: Callable[[str], Path],
                                                         family: str) -> None:
    """--kv-cache-dtype bfloat16 in every family (soft caps, sliding windows, MLA's
    latents, KV sharing): the numba decode attention and plain torch read the same
    rounded cache alike, and the rounding leaves most greedy continuations as float32's."""
    path = family_dir(family)
    runs = [greedy(engine(family, path, kv_cache_dtype="bfloat16", kernel_backend=backend))
            for backend in ("numba", "torch")]
    assert runs[0] == runs[1]
    assert sum(a == b for a, b in zip(runs[0], reference(path))) >= len(runs[0]) - 2
