"""GGUF's quantized weights kept packed on the CPU (``kernels.cpu.packed``,
``--quantization gguf``, the default for a quantized GGUF file), and int4 made at load
or read from an AWQ checkpoint on the same kernels.

Every format (Q4_0, Q4_1 and so int4, Q8_0, Q4_K, Q5_K, Q6_K) multiplies x rounded to
16-bit integers per block of 32 (``byte_dots``): the float32 product with the dequantized
weight and that rounded x, held here to 1e-5 of the largest output (float64 reference),
and within 1e-4 of the largest output of the product with x itself. An engine on packed
weights gives the same greedy tokens as one on the dequantized float32 weights, with
logprobs within 5e-2 (``ROUNDED_ATOL``; the largest seen 0.033, on the mixed Q4_K_M-like
random model, whose every layer rounds x).

With ``--packed-activations int8`` x is rounded to 8 bits per block of 32 (llama.cpp's
activations): the products are held to 1e-5 of that rounded x's, and an engine's greedy
tokens equal those of the float32 weights whose layers' inputs are rounded the same way
in torch, logprobs within 0.25 (``EIGHT_BIT_ATOL``). That is lossy: against float32
itself the tokens part within a few on the mixed model.
"""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from rvllm.kernels.cpu import packed as pk
from rvllm.kernels.cpu.f32_gemm import panels_matmul
from rvllm.kernels.cpu.gemv import gemv
from rvllm.models.dequant import dequantize

ROUNDED_ATOL = 5e-2  # logprobs of a model whose layers round x, against float32
EIGHT_BIT_ATOL = 0.25  # the same with x rounded to 8 bits (--packed-activations int8)
FORMATS = [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
# Byte ranges of each block's float16 fields (written finite and small).
_HALVES = {T.Q8_0: [(0, 2)], T.Q4_0: [(0, 2)], T.Q4_1: [(0, 2), (2, 4)],
           T.Q4_K: [(0, 2), (2, 4)], T.Q5_K: [(0, 2), (2, 4)], T.Q6_K: [(208, 210)]}


def random_rows(fmt: int, n: int, k: int, seed: int = 0, scale: float = 0.01) -> np.ndarray:
    """n rows of k weights as random GGUF blocks of ``fmt`` with finite float16 scales."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[fmt]
    data = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for a, b in _HALVES[fmt]:
        d = (rng.standard_normal((n, k // block, 1)) * scale).astype(np.float16)
        data[..., a:b] = d.view(np.uint8)
    return data.reshape(n, -1)


def packed_weight(fmt: int, n: int, k: int, seed: int = 0):
    raw = random_rows(fmt, n, k, seed)
    return raw, pk.pack_rows([pk.QuantizedRows(int(fmt), raw, k)], n)


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread) -> None:  # noqa: ANN001, PT004
    """The kernels on one thread: numba's pool and torch's agree."""


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_unpacking_the_panels_is_bit_identical_to_the_gguf_package(fmt) -> None:
    n, k = 37, 512  # rows not a multiple of the 16-row panel
    raw, panels = packed_weight(fmt, n, k)
    ours = pk.dequantize_panels(panels.weight, n, k)
    theirs = gguf.quants.dequantize(raw, fmt).reshape(n, k)
    assert torch.equal(ours, torch.from_numpy(theirs.astype(np.float32)))
    assert torch.equal(ours, dequantize(raw, fmt, (n, k)))
    assert panels.cols == k and panels.rows == n


def rounded(x: torch.Tensor, bits: int = 16) -> torch.Tensor:
    """x [B, K] rounded to integers per block of 32 and widened back (float64):
    rint(x * top / amax) times amax / top, top = 32385 (16 bits) or 127 (8 bits),
    written here apart from ``byte_dots``."""
    top = 32385.0 if bits == 16 else 127.0
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(top) / amax, torch.tensor(0.0))
    q = torch.round(blocks * inv)
    assert q.abs().max() <= top
    return (q.double() * (amax / top).double()).reshape(x.shape)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 33])
def test_packed_products_equal_float32_on_the_dequantized_weight(fmt, rows: int) -> None:
    n = 53
    k = 96 if pk.BLOCK_COLS[int(fmt)] == 32 else 768  # K not a multiple of 256 where allowed
    raw, panels = packed_weight(fmt, n, k, seed=rows)
    w = dequantize(raw, fmt, (n, k)).double()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    ours = gemv(x, panels) if rows == 1 else panels_matmul(x, panels)
    ref = x.double() @ w.T
    assert ours.shape == (rows, n)
    exact = rounded(x) @ w.T
    assert (ours.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    assert (ours.double() - ref).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.parametrize("pairs", [False, True], ids=["groups_of_4", "pairs"])
def test_q8_0_s_two_layouts_hold_the_same_weights_and_products(pairs: bool) -> None:
    """Q8_0 is laid out in pairs of columns for ``vpmaddwd`` (the default), or in groups
    of 4 for ``vpdpbusd``; each layout works on every CPU, and gives the same numbers as
    the other, with x rounded to 16 bits and to 8."""
    n, k = 37, 160
    raw = random_rows(T.Q8_0, n, k, seed=4)
    panels = pk.pack_rows([pk.QuantizedRows(int(T.Q8_0), raw, k)], n, pairs=pairs)
    other = pk.pack_rows([pk.QuantizedRows(int(T.Q8_0), raw, k)], n, pairs=not pairs)
    assert pk.panel_formats(panels.weight) == {int(T.Q8_0)}
    theirs = gguf.quants.dequantize(raw, T.Q8_0).reshape(n, k)
    assert torch.equal(pk.dequantize_panels(panels.weight, n, k),
                       torch.from_numpy(theirs.astype(np.float32)))
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(6))
    exact = rounded(x) @ torch.from_numpy(theirs).double().T
    for rows in (1, 3, 6):
        ours = gemv(x[:1], panels) if rows == 1 else panels_matmul(x[:rows], panels)
        assert (ours.double() - exact[:rows]).abs().max() <= 1e-5 * exact.abs().max()
        again = gemv(x[:1], other) if rows == 1 else panels_matmul(x[:rows], other)
        assert torch.equal(ours, again)
    for w in (panels, other):  # and with x rounded to 8 bits
        pk.set_x_bits(w.weight, 8)
    exact = rounded(x, 8) @ torch.from_numpy(theirs).double().T
    ours = panels_matmul(x, panels)
    assert (ours.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    assert torch.equal(ours, panels_matmul(x, other))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_a_row_s_product_is_the_same_number_in_any_batch(fmt) -> None:
    k = 96 if pk.BLOCK_COLS[int(fmt)] == 32 else 256
    raw, panels = packed_weight(fmt, 53, k)
    x = torch.randn(33, k, generator=torch.Generator().manual_seed(3))
    full = panels_matmul(x, panels)
    for rows in (1, 2, 3, 4, 5, 9):
        part = gemv(x[:1], panels) if rows == 1 else panels_matmul(x[:rows], panels)
        assert torch.equal(part, full[:rows])
    assert torch.equal(gemv(x[20:21], panels), full[20:21])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_eight_bit_x_gives_the_products_of_x_rounded_to_8_bits(fmt) -> None:
    """``set_x_bits(w, 8)``: every format multiplies x rounded to 8 bits per block of 32,
    each row the same number in any batch; back to 16 bits, the products are as before."""
    n = 53
    k = 96 if pk.BLOCK_COLS[int(fmt)] == 32 else 768
    raw, panels = packed_weight(fmt, n, k, seed=7)
    w = dequantize(raw, fmt, (n, k)).double()
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(7))
    sixteen = panels_matmul(x, panels)
    pk.set_x_bits(panels.weight, 8)
    full = panels_matmul(x, panels)
    exact = rounded(x, 8) @ w.T
    assert (full.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    ref = x.double() @ w.T
    assert (full.double() - ref).abs().max() <= 2e-2 * ref.abs().max()
    for rows in (1, 2, 3, 4, 5):
        part = gemv(x[:1], panels) if rows == 1 else panels_matmul(x[:rows], panels)
        assert torch.equal(part, full[:rows])
    pk.set_x_bits(panels.weight, 16)
    assert torch.equal(panels_matmul(x, panels), sixteen)
    with pytest.raises(ValueError, match="16 or 8 bits"):
        pk.set_x_bits(panels.weight, 4)


# What numba compiles for, by the instructions the packed products then take: plain
# integer IR without AVX2, AVX2's eight-lane walks (``packed._narrow_dots``), and vpmaddubsw on
# one AVX-512BW register without VNNI.
_CPUS = {"avx": ("ivybridge", "+64bit,+avx,+f16c,+sse4.2,+popcnt"),
         "avx2": ("haswell", "+64bit,+avx,+avx2,+fma,+f16c,+sse4.2,+popcnt,+bmi,+bmi2"),
         "avx512bw": ("skylake-avx512", "+64bit,+avx,+avx2,+fma,+f16c,+avx512f,+avx512bw,"
                                        "+avx512dq,+avx512vl,+avx512cd,+sse4.2,+popcnt")}
_PRODUCTS = """
import sys, numpy as np, torch
sys.path.insert(0, {tests!r})
from test_packed_weights import FORMATS, products
torch.set_num_threads(1)
np.save({out!r}, products(torch.from_numpy(np.load({x!r}))))
"""


def products(x: torch.Tensor) -> np.ndarray:
    """Each format's products with x, x rounded to 16 bits and to 8."""
    out = []
    for bits in (16, 8):
        for f in FORMATS:
            panels = packed_weight(f, 53, 256)[1]
            pk.set_x_bits(panels.weight, bits)
            out.append(panels_matmul(x, panels).numpy())
    return np.stack(out)


@pytest.mark.parametrize("cpu", [
    pytest.param("avx", marks=pytest.mark.slow), "avx2",
    pytest.param("avx512bw", marks=pytest.mark.slow)])  # a compile each: 1-4 min
def test_every_cpu_computes_the_same_integers(cpu: str, tmp_path: Path) -> None:
    """The packed products of every format compiled for another CPU (one whose
    instructions this one has) are bit for bit this machine's."""
    import os
    import subprocess
    import sys

    from numba.core.registry import cpu_target

    from rvllm.kernels.cpu.byte_dots import _features

    name, features = _CPUS[cpu]
    ours = set(_features(cpu_target.target_context).split(","))
    if any(f not in ours for f in features.split(",") if f.startswith("+avx")):
        pytest.skip(f"this CPU cannot run code compiled for {name}")
    # Of AVX and AVX2, the one whose code differs from ours.
    if cpu != "avx512bw" and (cpu == "avx2") != ("+avx512f" in ours):
        pytest.skip("the other of AVX and AVX2 is compared on this CPU")
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(5))
    np.save(tmp_path / "x.npy", x.numpy())
    env = dict(os.environ, NUMBA_CPU_NAME=name, NUMBA_CPU_FEATURES=features,
               NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    script = _PRODUCTS.format(tests=str(Path(__file__).parent), x=str(tmp_path / "x.npy"),
                              out=str(tmp_path / "out.npy"))
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=600)
    assert np.array_equal(np.load(tmp_path / "out.npy"), products(x))


def _panel_size(fmt: int, k: int) -> int:
    return -(-pk.panel_bytes(fmt, k) // 64) * 64


@pytest.mark.parametrize("layout", [
    [(T.Q4_K, 32), (T.Q6_K, 16), (T.Q8_0, 21)],  # three runs: each as long as it needs
    [(T.Q4_K, 16), (T.Q6_K, 16), (T.Q4_K, 16), (T.Q8_0, 21)],  # four: all the longest
], ids=["three-runs", "four-runs"])
def test_a_weight_of_mixed_formats_reads_each_panel_by_its_own(layout) -> None:
    k = 512
    parts = [pk.QuantizedRows(int(f), random_rows(f, rows, k, seed=i), k)
             for i, (f, rows) in enumerate(layout)]
    n = sum(rows for _, rows in layout)
    panels = pk.pack_rows(parts, n)
    counts = [-(-rows // 16) for _, rows in layout]
    if len(layout) <= 3:
        assert panels.nbytes == sum(c * _panel_size(f, k) for (f, _), c in zip(layout, counts))
    else:
        assert panels.nbytes == sum(counts) * max(_panel_size(f, k) for f, _ in layout)
    assert pk.panel_formats(panels.weight) == {int(f) for f, _ in layout}
    w = torch.cat([dequantize(p.data, p.fmt, (p.rows, k)) for p in parts])
    assert torch.equal(pk.dequantize_panels(panels.weight, n, k), w)
    x = torch.randn(3, k)
    ref = rounded(x) @ w.double().T
    for rows in (1, 3):
        ours = gemv(x[:1], panels) if rows == 1 else panels_matmul(x, panels)
        assert (ours.double() - ref[:rows]).abs().max() <= 1e-5 * ref.abs().max()


def test_packed_parts_must_start_on_a_panel() -> None:
    parts = [pk.QuantizedRows(int(T.Q8_0), random_rows(T.Q8_0, 10, 32), 32)] * 2
    with pytest.raises(ValueError, match="panel of 16 rows"):
        pk.pack_rows(parts, 20)


def test_embedding_rows_come_dequantized_from_the_panels() -> None:
    from rvllm.kernels.cpu.gemv import embedding_rows

    raw, panels = packed_weight(T.Q4_K, 40, 256)
    ids = torch.tensor([[0, 39, 17], [16, 15, 3]])
    rows = embedding_rows(torch.from_numpy(panels.weight), ids)
    assert torch.equal(rows, dequantize(raw, T.Q4_K, (40, 256))[ids])


def test_the_packed_bytes_are_the_file_s_within_three_percent() -> None:
    for fmt in FORMATS:
        n, k = 4096, 4096
        block, size = gguf.GGML_QUANT_SIZES[fmt]
        file_bytes = n * k // block * size
        ours = n // 16 * pk.panel_bytes(int(fmt), k)
        assert file_bytes <= ours <= 1.03 * file_bytes, fmt.name


def test_int4_groups_pack_as_q4_1_blocks() -> None:
    from rvllm.models.int4_checkpoint import quantize_int4_rtn

    w = torch.randn(40, 256) * 0.05
    for group in (32, 128):
        q = quantize_int4_rtn(w, group)
        rows = pk.int4_rows(q.q, q.scale, q.zero)
        ours = dequantize(rows.data, rows.fmt, (40, 256))
        # float16 d and m: each weight within 1/2048 of 15 d + |m| <= 31 d, under 2%
        # of a quantization step
        step = q.scale.repeat_interleave(group, dim=1)
        assert ((ours - q.dequantize()).abs() <= step / 64).all()


# --- models -----------------------------------------------------------------------------

# A tiny llama whose widths are whole k-quant blocks, each projection in its own format
# as llama.cpp's Q4_K_M mixes them (V and down in Q6_K, an untied Q6_K output).
_LAYER_TYPES = {"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K, "attn_output": T.Q5_K,
                "ffn_gate": T.Q4_K, "ffn_up": T.Q8_0, "ffn_down": T.Q6_K}


def write_quantized_llama(path: Path, tied: bool = False, layer_types: dict | None = None,
                          embedding: int = T.Q4_K) -> Path:
    from test_gguf import sentencepiece_vocab

    tokens, scores, types = sentencepiece_vocab()
    hidden, inter, heads, kv_heads, layers = 256, 512, 4, 2, 2
    dim = hidden // heads
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(dim)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    seed = iter(range(1000))

    def add(name: str, fmt: int, n: int, k: int) -> None:
        raw = random_rows(fmt, n, k, seed=next(seed), scale=0.002)
        writer.add_tensor(name, raw, raw_shape=(n, raw.shape[1]), raw_dtype=fmt)

    add("token_embd.weight", embedding, len(tokens), hidden)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    if not tied:
        add("output.weight", T.Q6_K, len(tokens), hidden)
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv_heads * dim, hidden),
              "attn_v": (kv_heads * dim, hidden), "attn_output": (hidden, hidden),
              "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden),
              "ffn_down": (hidden, inter)}
    for layer in range(layers):
        for kind, fmt in (layer_types or _LAYER_TYPES).items():
            add(f"blk.{layer}.{kind}.weight", fmt, *shapes[kind])
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight",
                              np.random.default_rng(layer).uniform(0.5, 1.5, hidden)
                              .astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def mixed_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_quantized_llama(tmp_path_factory.mktemp("packed") / "mixed.gguf")


def _generate(path: Path, quantization: str | None, prompts: list[list[int]], **kw):
    from rvllm import LLM

    return _outputs(LLM(str(path), quantization=quantization, **kw), prompts)


def _outputs(llm, prompts: list[list[int]]):  # noqa: ANN001, ANN202
    from rvllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params)
    return llm, [(o.outputs[0].token_ids,
                  [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                 for o in outs]


def _assert_same(packed: list, plain: list, atol: float = 1e-3) -> None:
    for (ids, lps), (ids_ref, lps_ref) in zip(packed, plain):
        assert ids == ids_ref
        assert np.allclose(lps, lps_ref, atol=atol)


PROMPTS = [[1, 5, 9, 200, 7], [1, 300], list(range(3, 40))]


def test_a_quantized_gguf_runs_packed_by_default_and_matches_float32(mixed_llama) -> None:
    llm, packed = _generate(mixed_llama, None, PROMPTS)
    engine = llm.engine
    assert engine.quantization == "gguf" and engine.model.linear_backend == "packed"
    model = engine.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.linear_kind == "packed" and qkv.weight.numel() == 0
    # Q and K (Q4_K) and V (Q6_K) panels each as long as their format needs
    assert qkv.panel_weight.nbytes == (24 * _panel_size(T.Q4_K, 256)
                                       + 8 * _panel_size(T.Q6_K, 256))
    assert model.model.embed_tokens.weight.numel() == 0  # its rows are read packed
    plan = model.model.step_plan()  # the compiled decode step takes the packed panels,
    assert plan is not None and plan.arrays.like.dtype == np.uint8  # layers of mixed types
    assert plan.head(model.lm_head) is not None  # and goes on through the Q6_K LM head
    _, plain = _generate(mixed_llama, "none", PROMPTS)
    _assert_same(packed, plain, atol=ROUNDED_ATOL)  # the Q8_0 up projection rounds x


def test_packed_weights_hold_under_batching_chunked_prefill_and_the_torch_path(
        mixed_llama) -> None:
    _, plain = _generate(mixed_llama, "none", PROMPTS)
    _, chunked = _generate(mixed_llama, "gguf", PROMPTS, max_num_batched_tokens=16,
                           enable_chunked_prefill=True, max_num_seqs=2)
    _assert_same(chunked, plain, atol=ROUNDED_ATOL)
    _, torch_path = _generate(mixed_llama, "gguf", PROMPTS, kernel_backend="torch")
    _assert_same(torch_path, plain, atol=ROUNDED_ATOL)


def test_a_tied_q8_0_embedding_feeds_the_lm_head_packed(tmp_path: Path) -> None:
    path = write_quantized_llama(tmp_path / "tied.gguf", tied=True, embedding=T.Q8_0,
                                 layer_types={k: T.Q4_1 for k in _LAYER_TYPES})
    llm, packed = _generate(path, None, PROMPTS)
    head = llm.engine.model.lm_head
    assert head.linear_kind == "packed"
    _, plain = _generate(path, "none", PROMPTS)
    _assert_same(packed, plain, atol=ROUNDED_ATOL)  # the Q4_1 layers and the Q8_0 head round x


def test_packed_activations_int8_match_float32_with_inputs_rounded_to_8_bits(
        mixed_llama) -> None:
    """``--packed-activations int8``: every packed layer multiplies x rounded to 8 bits
    per block of 32. Greedy tokens equal those of the float32 weights (the torch path)
    whose every linear layer's input is rounded so first, with and without chunked
    prefill, logprobs within ``EIGHT_BIT_ATOL`` (a value near a rounding tie goes either
    way). The float32 engine itself parts from them within a few tokens on this small
    random model, whose logits are far apart: the rounding is lossy. Refused where
    nothing runs packed."""
    from rvllm import LLM
    from rvllm.kernels.cpu.packed import eight_bit_x
    from rvllm.layers.cpu_linear import PackableLinear

    llm, eight = _generate(mixed_llama, None, PROMPTS, packed_activations="int8")
    assert llm.engine.settings()["packed_activations"] == "int8"
    layer = llm.engine.model.model.layers[0]
    assert all(eight_bit_x(m.panel_weight.weight)
               for m in (layer.self_attn.qkv_proj, layer.mlp.down_proj, llm.engine.model.lm_head))
    ref = LLM(str(mixed_llama), quantization="none", kernel_backend="torch")
    assert ref.engine.settings()["packed_activations"] is None  # nothing runs packed

    def round_input(module, args):  # noqa: ANN001, ANN202
        x = args[0]
        return (rounded(x.reshape(-1, x.shape[-1]), 8).float().view(x.shape), *args[1:])
    hooked = [m.register_forward_pre_hook(round_input) for m in ref.engine.model.modules()
              if isinstance(m, PackableLinear)]
    assert len(hooked) == 2 * 4 + 1  # qkv, o, gate_up and down of both layers, the LM head
    _, rounded_ref = _outputs(ref, PROMPTS)
    _assert_same(eight, rounded_ref, atol=EIGHT_BIT_ATOL)
    _, chunked = _generate(mixed_llama, None, PROMPTS, packed_activations="int8",
                           max_num_batched_tokens=16, max_num_seqs=2)
    _assert_same(chunked, rounded_ref, atol=EIGHT_BIT_ATOL)
    with pytest.raises(ValueError, match="is for weights kept packed"):
        _generate(mixed_llama, "none", PROMPTS, packed_activations="int8")


def test_int4_at_load_runs_on_the_packed_kernels(mixed_llama) -> None:
    llm, int4 = _generate(mixed_llama, "int4", PROMPTS[:1])
    assert llm.engine.model.model.layers[0].mlp.down_proj.linear_kind == "packed"
    assert len(int4[0][0]) == 12


def test_quantization_choices_this_machine_cannot_run_are_refused(mixed_llama,
                                                                  llama_dir) -> None:
    from rvllm import LLM

    with pytest.raises(ValueError, match="fp8 needs a CUDA GPU"):
        LLM(str(mixed_llama), quantization="fp8")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        LLM(str(llama_dir), quantization="gguf")
    with pytest.raises(ValueError, match="not a awq checkpoint"):
        LLM(str(llama_dir), quantization="awq")


def test_tensor_parallel_widens_a_quantized_gguf_and_says_so(mixed_llama, caplog) -> None:
    from rvllm.engine.engine_startup import resolve_quantization

    cpu = torch.device("cpu")
    assert resolve_quantization(None, str(mixed_llama), cpu, torch.float32) == "gguf"
    with caplog.at_level(logging.WARNING, logger="rvllm"):
        assert resolve_quantization(None, str(mixed_llama), cpu, torch.float32,
                                    tensor_parallel_size=2) is None
    assert "widened to float32" in caplog.text
    with pytest.raises(ValueError, match="leave --tensor-parallel-size at 1"):
        resolve_quantization("gguf", str(mixed_llama), cpu, torch.float32,
                             tensor_parallel_size=2)


def _int4_checkpoint(src: Path, dst: Path, method: str) -> tuple[Path, Path]:
    """The test Llama's linear weights as an int4 checkpoint (``method``: GPTQ
    symmetric, group 32, or AWQ, group 32) in ``dst``, and beside it (``dst``-float) the
    same model with those weights dequantized: what the packed kernels must compute."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from test_int4_checkpoint import (
        awq_config,
        awq_tensors,
        gptq_config,
        gptq_tensors,
        quantize_sym,
    )

    from rvllm.models.int4_checkpoint import quantize_int4_rtn

    plain = dst.parent / f"{dst.name}-float"
    for d in (dst, plain):
        shutil.copytree(src, d)
        for f in d.glob("*.safetensors"):
            f.unlink()
    state = load_file(str(next(src.glob("*.safetensors"))))
    quantized, dequantized = {}, {}
    linear = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for name, tensor in state.items():
        if not (name.endswith(".weight") and any(f".{p}." in name for p in linear)):
            quantized[name] = dequantized[name] = tensor
            continue
        prefix = name.removesuffix(".weight")
        q = quantize_sym(tensor, 32) if method == "gptq" else quantize_int4_rtn(tensor, 32)
        q = type(q)(q.q, q.scale.half().float(), q.zero, q.group)  # scales stored fp16
        parts = (gptq_tensors(q, gptq_config(32, True)) if method == "gptq"
                 else awq_tensors(q, awq_config(32)))
        quantized.update({f"{prefix}.{k}": v for k, v in parts.items()})
        dequantized[name] = q.dequantize()
    save_file(quantized, str(dst / "model.safetensors"))
    save_file(dequantized, str(plain / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = (gptq_config(32, True) if method == "gptq"
                                     else awq_config(32))
    (dst / "config.json").write_text(json.dumps(config))
    return dst, plain


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_an_int4_checkpoint_runs_packed_like_its_dequantized_weights(
        method: str, llama_dir: Path, tmp_path: Path) -> None:
    int4_dir, plain_dir = _int4_checkpoint(llama_dir, tmp_path / method, method)
    prompts = [[1, 5, 9, 20, 7], list(range(3, 30))]
    llm, packed = _generate(int4_dir, None, prompts)
    assert llm.engine.quantization == method
    assert llm.engine.model.model.layers[1].self_attn.qkv_proj.linear_kind == "packed"
    _, plain = _generate(plain_dir, None, prompts)
    if method == "gptq":  # symmetric: d = scale and m = -8 scale are exact in float16
        _assert_same(packed, plain, atol=ROUNDED_ATOL)  # Q4_1 blocks round x
    else:  # AWQ's m = -scale * zero is rounded to float16: within 1/2048 of each offset
        for (ids, lps), (ids_ref, lps_ref) in zip(packed, plain):
            assert ids[:4] == ids_ref[:4]
            assert np.allclose(lps[:4], lps_ref[:4], atol=ROUNDED_ATOL)
