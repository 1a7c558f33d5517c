"""GGUF files of every family llama.cpp and rvllm share load as the Hugging Face model.

Each tiny seeded transformers model is written to GGUF the way llama.cpp's
convert_hf_to_gguf.py writes that family (its metadata keys, tensor names and
transforms: Gemma's norm + 1, the llama Q/K permutation, stacked experts, DeepSeek-V2's
kv_b_proj split in k_b and v_b), then rvllm must read back HF's exact tensors and config
and generate greedily exactly what transformers generates.

What a GGUF cannot carry is set in the HF configs to what llama.cpp assumes: Gemma 2/3's
query_pre_attn_scalar is head_dim, Gemma 3 slides on five layers of six, Qwen3-MoE
renormalizes its top-k and has experts in every layer, Phi-2 has no q/k norms nor grouped
KV heads, and Mixtral (stored as llama) no sliding window.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from test_gguf import llama_cpp_permute, sentencepiece_vocab
from test_model_families import BASE, FAMILIES

from rvllm.models.gguf_loader import GGUFFile, iter_gguf_tensors, load_gguf_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 8
PROMPT_LENS = (1, 5, 23)  # the longest runs past the sliding windows (16)

# rvllm family -> (GGUF architecture, HF config overrides). The overrides replace what GGUF
# cannot represent with what llama.cpp assumes (see the module docstring).
GGUF_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma": ("gemma", {}),
    "gemma2": ("gemma2", dict(query_pre_attn_scalar=16)),
    "gemma3": ("gemma3", dict(query_pre_attn_scalar=16, num_hidden_layers=6, layer_types=None,
                              final_logit_softcapping=2.5)),
    "phi3": ("phi3", {}),
    "phi": ("phi2", dict(qk_layernorm=False, num_key_value_heads=4)),
    "mixtral": ("llama", dict(sliding_window=None)),
    "qwen3_moe": ("qwen3moe", dict(mlp_only_layers=[], norm_topk_prob=True)),
    "deepseek_v2": ("deepseek2", {}),
    "deepseek_v2_lite": ("deepseek2", {}),
}


def tiny_model(family: str, vocab_size: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    overrides, seed = FAMILIES[family][:2]
    kwargs = {**BASE, **overrides, **GGUF_FAMILIES[family][1], "vocab_size": vocab_size,
              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    kwargs = {k: v for k, v in kwargs.items()
              if v is not None or k in ("sliding_window", "q_lora_rank")}
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if family.startswith("gemma") and name.endswith("norm.weight"):
                # Gemma checkpoints are bfloat16, where w + 1 (the converter adds it in
                # float32) is exact; random float32 norms would not survive the + 1.
                sign = torch.randint(0, 2, p.shape).float() * 2 - 1
                p.copy_((sign * torch.empty_like(p).uniform_(0.1, 0.6)).bfloat16().float())
            elif "norm" in name and name.endswith(".weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.add_(0.2 * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    return model


# ---------------------------------------------------------------- a GGUF as the converter writes it


def hf_tensors_as_converted(arch: str, model) -> Iterator[tuple[str, np.ndarray]]:
    """The HF tensors under convert_hf_to_gguf's names, transformed as it transforms them."""
    cfg = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        data = tensor.numpy()
        layer = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else None
        if hf_name == "lm_head.weight" and (cfg.tie_word_embeddings or arch.startswith("gemma")):
            continue  # Gemma's converters always drop lm_head
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            data = data + np.float32(1)
        if arch == "llama" and ".q_proj." in hf_name:
            data = llama_cpp_permute(data, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            data = llama_cpp_permute(data, cfg.num_key_value_heads)
        if hf_name.endswith(".experts.gate_up_proj"):  # stacked [E, 2I, H]: gate, then up
            gate, up = np.split(data, 2, axis=1)
            yield f"blk.{layer}.ffn_gate_exps.weight", gate
            yield f"blk.{layer}.ffn_up_exps.weight", up
        elif hf_name.endswith(".experts.down_proj"):
            yield f"blk.{layer}.ffn_down_exps.weight", data
        elif hf_name.endswith(".kv_b_proj.weight"):
            # MLA absorption: per head, k_b (nope rows) transposed and v_b (v rows).
            kv_b = data.reshape(cfg.num_attention_heads,
                                cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
            yield f"blk.{layer}.attn_k_b.weight", kv_b[:, :cfg.qk_nope_head_dim].swapaxes(1, 2)
            yield f"blk.{layer}.attn_v_b.weight", kv_b[:, cfg.qk_nope_head_dim:]
        else:
            gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, hf_name
            yield gguf_name, data
    if arch == "phi3":
        rope = cfg.rope_parameters
        yield "rope_factors_long.weight", np.array(rope["long_factor"], np.float32)
        yield "rope_factors_short.weight", np.array(rope["short_factor"], np.float32)


def write_metadata(w: gguf.GGUFWriter, arch: str, cfg, legacy_mla: bool = False) -> None:
    """The hyperparameters each family's converter writes (set_gguf_parameters); with
    ``legacy_mla``, DeepSeek-V2's MLA sizes as converters wrote them before the kv_b split."""
    rope = cfg.rope_parameters
    full = rope.get("full_attention", rope)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    if arch == "phi2":
        w.add_feed_forward_length(4 * cfg.hidden_size)
        w.add_head_count_kv(cfg.num_attention_heads)
        w.add_layer_norm_eps(cfg.layer_norm_eps)
        w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * cfg.hidden_size)
                                   // cfg.num_attention_heads)
        return
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count_kv(1 if arch == "deepseek2" else cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch != "gemma" and arch != "gemma2":
        w.add_rope_freq_base(full["rope_theta"])
    if arch.startswith("gemma") or arch == "qwen3moe":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma3":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "phi3":
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * cfg.hidden_size)
                                   // cfg.num_attention_heads)
        w.add_sliding_window(cfg.sliding_window or 0)
        w.add_rope_scaling_attn_factors(
            float(np.sqrt(1 + np.log(cfg.max_position_embeddings
                                     / rope["original_max_position_embeddings"])
                          / np.log(rope["original_max_position_embeddings"]))))
    if arch == "llama":
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(head_dim)
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch == "qwen3moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "deepseek2":
        w.add_expert_count(cfg.n_routed_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_leading_dense_block_count(cfg.first_k_dense_replace)
        w.add_vocab_size(cfg.vocab_size)
        if cfg.q_lora_rank is not None:  # as the converter: V2-Lite writes none
            w.add_q_lora_rank(cfg.q_lora_rank)
        w.add_kv_lora_rank(cfg.kv_lora_rank)
        if legacy_mla:
            w.add_key_length(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
            w.add_value_length(cfg.v_head_dim)
        else:
            w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
            w.add_value_length(cfg.kv_lora_rank)
            w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
            w.add_value_length_mla(cfg.v_head_dim)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_expert_weights_scale(cfg.routed_scaling_factor)
        w.add_rope_dimension_count(cfg.qk_rope_head_dim)
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def fused(tensors: dict[str, np.ndarray], parts: list[str], name: str, axis: int
          ) -> dict[str, np.ndarray]:
    """``tensors`` with ``parts`` concatenated into ``name``, where the first part was."""
    out = {}
    for key, data in tensors.items():
        if key == parts[0]:
            out[name] = np.concatenate([tensors[p] for p in parts], axis=axis)
        elif key not in parts:
            out[key] = data
    return out


def converter_options(tensors: dict[str, np.ndarray], n_layers: int, fuse_qkv: bool = False,
                      fuse_gate_up_exps: bool = False, unsplit_kv_b: bool = False
                      ) -> dict[str, np.ndarray]:
    """The converter's --fuse-qkv and --fuse-gate-up-exps, and the kv_b_proj of GGUFs
    converted before llama.cpp split it."""
    for i in range(n_layers):
        for suffix in ("weight", "bias"):
            qkv = [f"blk.{i}.attn_{p}.{suffix}" for p in "qkv"]
            if fuse_qkv and all(n in tensors for n in qkv):
                tensors = fused(tensors, qkv, f"blk.{i}.attn_qkv.{suffix}", 0)
        exps = [f"blk.{i}.ffn_gate_exps.weight", f"blk.{i}.ffn_up_exps.weight"]
        if fuse_gate_up_exps and exps[0] in tensors:
            tensors = fused(tensors, exps, f"blk.{i}.ffn_gate_up_exps.weight", 1)
        k_b, v_b = f"blk.{i}.attn_k_b.weight", f"blk.{i}.attn_v_b.weight"
        if unsplit_kv_b and k_b in tensors:
            tensors[k_b] = tensors[k_b].swapaxes(1, 2)
            kv_b = fused(tensors, [k_b, v_b], "kv_b", 1)
            tensors = {(f"blk.{i}.attn_kv_b.weight" if k == "kv_b" else k):
                       (v.reshape(-1, v.shape[-1]) if k == "kv_b" else v)
                       for k, v in kv_b.items()}
    return tensors


def write_family_gguf(path: Path, arch: str, model, vocab: tuple[list, list, list],
                      **options: bool) -> Path:
    tokens, scores, types = vocab
    w = gguf.GGUFWriter(path, arch)
    write_metadata(w, arch, model.config, legacy_mla=options.get("unsplit_kv_b", False))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    tensors = converter_options(dict(hf_tensors_as_converted(arch, model)),
                                model.config.num_hidden_layers, **options)
    for name, data in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def vocab() -> tuple[list, list, list]:
    return sentencepiece_vocab()


@pytest.fixture(scope="module")
def family_gguf(tmp_path_factory: pytest.TempPathFactory, vocab):
    built: dict[str, tuple[Path, Any]] = {}

    def get(family: str) -> tuple[Path, Any]:
        if family not in built:
            model = tiny_model(family, len(vocab[0]))
            path = tmp_path_factory.mktemp("gguf") / f"{family}.gguf"
            built[family] = (write_family_gguf(path, GGUF_FAMILIES[family][0], model, vocab),
                             model)
        return built[family]

    return get


# ---------------------------------------------------------------- the specification


@pytest.mark.parametrize("family", list(GGUF_FAMILIES))
def test_gguf_family_tensors_equal_the_hf_state_dict(family: str, family_gguf) -> None:
    path, model = family_gguf(family)
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    ours = dict(iter_gguf_tensors(path))
    assert set(ours) == set(expected)
    for name, tensor in expected.items():
        assert ours[name].shape == tensor.shape, name
        assert torch.equal(ours[name], tensor), name


# Keys whose spelling differs between our (transformers 4 style) config and transformers 5's
# to_dict(), checked apart below; and HF defaults a GGUF does not carry, unused by rvllm.
_SPELLED_APART = {"rope_theta", "rope_scaling", "rope_parameters", "rope_local_base_freq",
                  "architectures", "transformers_version", "dtype"}


@pytest.mark.parametrize("family", list(GGUF_FAMILIES))
def test_gguf_family_config_matches_the_hf_config(family: str, family_gguf) -> None:
    path, model = family_gguf(family)
    ours, hf = load_gguf_config(path), model.config.to_dict()
    assert ours["architectures"] == [type(model).__name__]
    shared = sorted(set(ours) & set(hf) - _SPELLED_APART)
    assert {"hidden_size", "num_key_value_heads", "vocab_size", "tie_word_embeddings"} <= set(
        shared)
    if family == "qwen3_moe":  # transformers 5 renames num_experts
        assert ours["num_experts"] == hf["num_local_experts"]
    for key in shared:
        if key == "head_dim" and hf[key] is None:  # transformers derives it
            assert ours[key] == hf["hidden_size"] // hf["num_attention_heads"]
        else:
            assert ours[key] == hf[key], key
    rope = hf["rope_parameters"]
    if family == "gemma3":
        assert ours["rope_theta"] == rope["full_attention"]["rope_theta"]
        assert ours["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
        assert ours["rope_local_base_freq"] == rope["sliding_attention"]["rope_theta"]
        return
    assert ours["rope_theta"] == rope["rope_theta"]
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor",
                                                           "original_max_position_embeddings")}
    if scaling.get("rope_type", "default") == "default":
        assert "rope_scaling" not in ours
    else:
        assert ours["rope_scaling"] == {**scaling, **(
            {"original_max_position_embeddings": rope["original_max_position_embeddings"]}
            if scaling["rope_type"] == "yarn" else {})}


def hf_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    outs = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=0)
        outs.append(out[0, len(ids):].tolist())
    return outs


@pytest.mark.parametrize("family", list(GGUF_FAMILIES))
def test_gguf_family_generates_like_the_hf_model(family: str, family_gguf) -> None:
    from rvllm import LLM, SamplingParams

    path, model = family_gguf(family)
    vocab = model.config.vocab_size
    prompts = [[(7 * i + 3) % vocab for i in range(n)] for n in PROMPT_LENS]
    llm_kwargs = FAMILIES[family][2] if len(FAMILIES[family]) > 2 else {}
    llm = LLM(str(path), device="cpu", dtype="float32", **llm_kwargs)
    assert llm.engine.model_config.architecture == type(model).__name__
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model, prompts)


# (family, converter options): the layouts llama.cpp's converter writes besides its default.
VARIANTS = [
    ("mixtral", dict(fuse_qkv=True, fuse_gate_up_exps=True)),
    ("phi", dict(fuse_qkv=True)),
    ("deepseek_v2", dict(unsplit_kv_b=True)),
]


@pytest.mark.parametrize("family, options", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_gguf_converter_variants_yield_the_hf_state_dict(family: str, options: dict,
                                                         family_gguf, vocab, tmp_path) -> None:
    _, model = family_gguf(family)
    path = write_family_gguf(tmp_path / "variant.gguf", GGUF_FAMILIES[family][0], model, vocab,
                             **options)
    names = set(GGUFFile(path).tensors)
    assert ("blk.0.attn_qkv.weight" in names) == options.get("fuse_qkv", False)
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    ours = dict(iter_gguf_tensors(path))
    assert set(ours) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name
    config = load_gguf_config(path)
    for key in ("qk_nope_head_dim", "v_head_dim", "kv_lora_rank", "num_key_value_heads"):
        if key in config:
            assert config[key] == getattr(model.config, key), key


def test_deepseek_v3_routing_is_refused_by_name(family_gguf, vocab, tmp_path) -> None:
    _, model = family_gguf("deepseek_v2")
    path = tmp_path / "v3.gguf"
    w = gguf.GGUFWriter(path, "deepseek2")
    write_metadata(w, "deepseek2", model.config)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="DeepSeek-V3 style"):
        load_gguf_config(path)
