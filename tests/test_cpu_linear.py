"""The CPU linear fast paths (oneDNN packed float32, fbgemm fp16 and int8) against their
plain-torch references, and what they do to a real model's accuracy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rvllm.layers.cpu_linear import (
    finish_linear_weights,
    int8_available,
    int8_linear_reference,
    onednn_available,
    prepare_linear_weights,
    quantize_int8,
    reorder_pending,
)
from rvllm.layers.embedding import ParallelLMHead
from rvllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")
needs_fbgemm = pytest.mark.skipif(not int8_available(), reason="torch built without fbgemm")
# Plain torch kernels unless a test asks for numba's (which add the one-row GEMV).
pytestmark = pytest.mark.usefixtures("kernel_backend")


class Block(nn.Module):
    """One of each linear kind, filled with seeded random weights."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = QKVParallelLinear(48, 8, 4, 2, bias=True)
        self.gate_up = MergedColumnParallelLinear(48, [40, 40])
        self.col = ColumnParallelLinear(48, 24, bias=True)
        self.row = RowParallelLinear(80, 48, bias=True)
        self.lm_head = ParallelLMHead(100, 48)
        for p in self.parameters():
            p.data.normal_()

    def outputs(self, x: torch.Tensor, h: torch.Tensor) -> list[torch.Tensor]:
        return [self.qkv(x), self.gate_up(x), self.col(x), self.row(h),
                self.lm_head.compute_logits(x)]

    def int8_references(self, x: torch.Tensor, h: torch.Tensor, reference: callable
                        ) -> list[torch.Tensor]:
        """Each layer's ``reference(input, q, scale)`` on its int8 weight, plus its bias
        (in ``outputs``' order)."""
        expected = []
        for layer, inp in zip([self.qkv, self.gate_up, self.col, self.row, self.lm_head],
                              [x, x, x, h, x]):
            q, scale = quantize_int8(layer.weight)
            y = reference(inp, q, scale)
            expected.append(y if layer.bias is None else y + layer.bias)
        return expected

    def references(self, x: torch.Tensor, h: torch.Tensor, weight: callable
                   ) -> list[torch.Tensor]:
        return [F.linear(x, weight(self.qkv.weight), self.qkv.bias),
                F.linear(x, weight(self.gate_up.weight)),
                F.linear(x, weight(self.col.weight), self.col.bias),
                F.linear(h, weight(self.row.weight), self.row.bias),
                F.linear(x, weight(self.lm_head.weight))]


def dequantized_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor
                       ) -> torch.Tensor:
    return F.linear(x, q.float() * scale[:, None])


def inputs(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows)
    return torch.randn(rows, 48, generator=gen), torch.randn(rows, 80, generator=gen)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 32, 100])
def test_onednn_packed_linear_equals_f_linear(rows: int) -> None:
    block = Block()
    x, h = inputs(rows)
    expected = block.references(x, h, lambda w: w.clone())
    assert prepare_linear_weights(block, "auto") == "onednn"
    assert block.col.weight.numel() == 0  # the plain copy was released
    for got, want in zip(block.outputs(x, h), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@needs_fbgemm
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_fp16_weights_equal_f_linear_on_the_rounded_weight(rows: int) -> None:
    block = Block()
    x, h = inputs(rows)
    expected = block.references(x, h, lambda w: w.half().float())
    assert prepare_linear_weights(block, "auto", "fp16") == "fp16"
    for got, want in zip(block.outputs(x, h), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@needs_fbgemm
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_int8_path_equals_its_plain_torch_reference(rows: int) -> None:
    block = Block()
    x, h = inputs(rows)
    expected = block.int8_references(x, h, int8_linear_reference)
    assert prepare_linear_weights(block, "auto", "int8") == "int8"
    for got, want in zip(block.outputs(x, h), expected):
        # One quantization step of an input can round the other way: allow a few of them.
        tol = 3 * want.abs().max().item() / 127
        torch.testing.assert_close(got, want, rtol=0, atol=tol)


@needs_onednn
@pytest.mark.parametrize("kernel_backend", ["numba"], indirect=True)
def test_numba_rows_read_the_panels_and_equal_f_linear(kernel_backend) -> None:
    block = Block()
    inputs_by_rows = {rows: inputs(rows) for rows in (1, 4)}
    expected = {rows: block.references(x, h, lambda w: w.clone())
                for rows, (x, h) in inputs_by_rows.items()}
    assert prepare_linear_weights(block, "auto") == "onednn"
    # One row: the GEMV; more: f32_gemm; both over the same panels.
    assert block.col.panel_weight.weight.shape == (2, 48, 16)
    for rows, (x, h) in inputs_by_rows.items():
        for got, want in zip(block.outputs(x, h), expected[rows]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@needs_fbgemm
@pytest.mark.parametrize("kernel_backend", ["numba"], indirect=True)
def test_numba_one_row_int8_gemv_is_f_linear_on_the_dequantized_weight(kernel_backend) -> None:
    block = Block()
    x, h = inputs(1)
    expected = block.int8_references(x, h, dequantized_linear)
    assert prepare_linear_weights(block, "auto", "int8") == "int8"
    for got, want in zip(block.outputs(x, h), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@needs_fbgemm
@pytest.mark.parametrize("rows", [2, 5, 64])
@pytest.mark.parametrize("kernel_backend", ["numba"], indirect=True)
def test_numba_int8_rows_are_f_linear_on_the_dequantized_weight(rows: int,
                                                                kernel_backend) -> None:
    # Past one row, kernels.cpu.int8_gemm: each row quantized to 16-bit levels, within
    # 1e-4 of the float32 product (fbgemm's 7-bit rows: 1-2e-2); no fbgemm copy is made.
    block = Block()
    x, h = inputs(rows)
    expected = block.int8_references(x, h, dequantized_linear)
    assert prepare_linear_weights(block, "auto", "int8") == "int8"
    assert all(layer.packed_weight is None
               for layer in (block.qkv, block.gate_up, block.col, block.row, block.lm_head))
    for got, want in zip(block.outputs(x, h), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())


@needs_fbgemm
@pytest.mark.parametrize("kernel_backend", ["numba"], indirect=True)
def test_numba_int8_with_an_odd_input_width_keeps_fbgemm(kernel_backend) -> None:
    layer = ColumnParallelLinear(47, 24)
    torch.manual_seed(1)
    layer.weight.data.normal_()
    q, scale = quantize_int8(layer.weight)
    x = torch.randn(5, 47)
    prepare_linear_weights(layer, "auto", "int8")
    assert layer.packed_weight is not None
    want = int8_linear_reference(x, q, scale)
    torch.testing.assert_close(layer(x), want, rtol=0, atol=3 * want.abs().max().item() / 127)


@pytest.mark.parametrize("rows, k, n", [(1, 2, 1), (3, 6, 17), (4, 64, 32), (9, 576, 40),
                                        (33, 1536, 21)])
def test_int8_matmul_equals_f_linear_on_the_dequantized_weight(rows: int, k: int,
                                                               n: int) -> None:
    # Rows past a multiple of 4 and outputs past a multiple of 16 go through the edge
    # tile; K = 1536 quantizes to 11,008 levels.
    from rvllm.kernels.cpu.gemv import panels
    from rvllm.kernels.cpu.int8_gemm import int8_matmul, levels

    gen = torch.Generator().manual_seed(k)
    q, scale = quantize_int8(torch.randn(n, k, generator=gen))
    x = torch.randn(rows, k, generator=gen) * 5
    want = F.linear(x, q.float() * scale[:, None])
    got = int8_matmul(x, panels(q, scale))
    # Each activation is off by at most half a level of its row's largest magnitude.
    bound = 0.5 * x.abs().amax(dim=1, keepdim=True) / levels(k) * (q.float().abs()
                                                                    * scale[:, None]).sum(1)
    assert ((got - want).abs() <= bound * 1.01 + 1e-6).all()
    assert levels(576) == 29356 and levels(1536) == 11008


@pytest.mark.parametrize("rows, k, n", [(1, 4, 17), (2, 16, 16), (3, 8, 33), (7, 64, 40),
                                        (31, 576, 96), (251, 576, 20)])
def test_float32_matmul_over_panels_equals_f_linear(rows: int, k: int, n: int) -> None:
    # Six rows a tile, then pairs, an odd last row as a pair of itself; outputs past a
    # multiple of 16 through the scratch tile; 251 rows: chunks of 84 (K = 576).
    from rvllm.kernels.cpu.f32_gemm import float32_matmul
    from rvllm.kernels.cpu.gemv import panels

    gen = torch.Generator().manual_seed(rows)
    w, x = torch.randn(n, k, generator=gen), torch.randn(rows, k, generator=gen)
    torch.testing.assert_close(float32_matmul(x, panels(w)), F.linear(x, w), rtol=1e-5,
                               atol=1e-4)


def test_int8_matmul_sums_do_not_overflow_at_the_largest_levels() -> None:
    from rvllm.kernels.cpu.gemv import panels
    from rvllm.kernels.cpu.int8_gemm import int8_matmul

    k = 1536  # every product at its largest: k * 11,008 * 127 is just under 2^31
    q = torch.full((16, k), 127, dtype=torch.int8)
    q[1] = -127
    got = int8_matmul(torch.ones(4, k), panels(q, torch.ones(16)))
    assert got[:, 0].eq(127.0 * k).all() and got[:, 1].eq(-127.0 * k).all()


def test_int8_quantization_is_per_output_row_and_symmetric() -> None:
    w = torch.tensor([[0.5, -1.0, 0.25], [2.0, 1.0, -2.0]])
    q, scale = quantize_int8(w)
    torch.testing.assert_close(scale, torch.tensor([1.0, 2.0]) / 127)
    assert q.tolist() == [[64, -127, 32], [127, 64, -127]]


def test_numba_int8_quantization_is_bit_identical_to_torch() -> None:
    from rvllm.kernels.cpu.quantize import quantize_int8 as numba_quantize_int8

    torch.manual_seed(0)
    # Rows from 1e-12 to 1e3 in scale (the smallest hit the 1e-10 scale floor), a zero row,
    # and quotients exactly halfway between integers (torch.round rounds them to even).
    w = torch.randn(300, 577) * torch.logspace(-12, 3, 300)[:, None]
    w[0] = 0
    w[1, :5] = torch.tensor([127.0, 0.5, 1.5, -2.5, 63.5])
    w[2, :4] = torch.tensor([-254.0, 1.0, 3.0, -5.0])
    for weight in (w, torch.randn(192, 64).t()):  # and a transposed (strided) one
        q, scale = quantize_int8(weight)
        got_q, got_scale = numba_quantize_int8(weight)
        assert torch.equal(got_q, q) and torch.equal(got_scale, scale)
    assert numba_quantize_int8(w)[0][1, :5].tolist() == [127, 0, 2, -2, 64]


@needs_fbgemm
@pytest.mark.parametrize("quantization", ["fp16", "int8"])
def test_packing_left_running_gives_the_same_weights_once_finished(quantization: str) -> None:
    """``wait=False`` (what the engine does while its tokenizer loads): until
    ``finish_linear_weights`` a layer has no packed weight and a forward fails; after it,
    the outputs are those of packing in place."""
    x, h = inputs(4)
    waited = Block()
    prepare_linear_weights(waited, "auto", quantization)
    want = waited.outputs(x, h)
    block = Block()
    assert prepare_linear_weights(block, "auto", quantization, wait=False) == quantization
    assert not hasattr(block.col, "packed_weight")
    with pytest.raises(AttributeError):
        block.col(x)
    finish_linear_weights(block)
    finish_linear_weights(block)  # nothing left: a no-op
    for got, expected in zip(block.outputs(x, h), want):
        assert torch.equal(got, expected)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 32])
def test_deferred_reorders_compute_the_same_before_during_and_after(rows: int) -> None:
    """``defer_reorders`` (a server's start): layers use their plain weight until
    ``reorder_pending`` packs them, a few at a time; the outputs stay F.linear's all along,
    and once every layer is packed the model is what packing in place gives."""
    x, h = inputs(rows)
    block = Block()
    expected = block.references(x, h, lambda w: w.clone())
    packed = Block()
    prepare_linear_weights(packed, "auto")
    assert prepare_linear_weights(block, "auto", defer_reorders=True) == "onednn"
    assert len(block.pending_reorders) == 5
    assert block.col.packed_weight is None and block.col.weight.numel() > 0
    for got, want in zip(block.outputs(x, h), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert reorder_pending(block, limit=2)  # two done, three left
    assert len(block.pending_reorders) == 3
    for got, want in zip(block.outputs(x, h), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert not reorder_pending(block, seconds=60.0)  # the rest
    assert "pending_reorders" not in block.__dict__ and not reorder_pending(block)
    for got, want in zip(block.outputs(x, h), packed.outputs(x, h)):
        assert torch.equal(got, want)
    assert block.col.weight.numel() == 0  # released once packed
    assert block.lm_head.weight.numel() == packed.lm_head.weight.numel()


def test_panels_made_in_place_equal_the_copied_panels_and_give_the_rows_back() -> None:
    from rvllm.kernels.cpu.gemv import panels, panels_in_place

    for rows, cols in ((16, 5), (48, 577), (4096, 64)):  # one chunk, several, a short last
        weight = torch.randn(rows, cols)
        want = panels(weight)
        copy = weight.clone()
        got = panels_in_place(copy)
        assert np.array_equal(got.weight, want.weight) and got.rows == rows
        assert got.weight.ctypes.data == copy.data_ptr()  # the weight's own memory
        back = torch.from_numpy(got.weight).transpose(1, 2).reshape(rows, cols)
        assert torch.equal(back, weight)  # row 16p + j is column j of panel p
    with pytest.raises(ValueError, match="multiple of 16"):
        panels_in_place(torch.randn(24, 8))


def test_embedding_rows_come_from_panels_or_rows_alike() -> None:
    from rvllm.kernels.cpu.gemv import embedding_rows, embedding_table, panels_in_place

    weight = torch.randn(64, 7)
    ids = torch.tensor([[0, 17, 63], [5, 5, 48]])
    plain = embedding_table(weight)
    assert plain.shape == (64, 7, 1) and plain.data_ptr() == weight.data_ptr()
    assert torch.equal(embedding_rows(plain, ids), weight[ids])
    param = torch.nn.Parameter(weight.clone(), requires_grad=False)
    param.row_panels = panels_in_place(param.data)
    table = embedding_table(param)
    assert table.shape == (4, 7, 16)
    got = embedding_rows(table, ids)
    assert got.shape == (2, 3, 7) and got.is_contiguous() and torch.equal(got, weight[ids])


@needs_onednn
@pytest.mark.parametrize("kernel_backend", ["numba"], indirect=True)
@pytest.mark.parametrize("rows", [1, 3, 32])
def test_numba_float32_layers_keep_one_copy_in_panels_deferred_or_not(
        kernel_backend, rows: int) -> None:
    """With the numba kernels every input reads the panels, so no oneDNN copy is made.
    A server's start (deferred) makes the panels in the weight's own memory where they
    fill it (16 rows a panel) and leaves only their move into huge pages for later; the
    outputs are F.linear's before and after it, and the same as an undeferred start's."""
    x, h = inputs(rows)
    block = Block()
    expected = block.references(x, h, lambda w: w.clone())
    packed = Block()
    prepare_linear_weights(packed, "auto")
    layers = ("qkv", "gate_up", "col", "row", "lm_head")
    assert all(getattr(packed, n).packed_weight is None for n in layers)
    assert all(getattr(packed, n).weight.numel() == 0 for n in layers)
    assert not reorder_pending(packed)
    in_place = [block.qkv, block.gate_up, block.row]  # 64, 80 and 48 rows
    memory = [m.weight.data_ptr() for m in in_place]
    prepare_linear_weights(block, "auto", defer_reorders=True)
    assert [id(m) for m in block.pending_reorders] == [id(m) for m in in_place]
    assert all(m.weight.numel() == 0 and m.packed_weight is None for m in in_place)
    assert [m.panel_weight.weight.ctypes.data for m in in_place] == memory
    assert block.col.weight.numel() == 0  # 24 rows: panels of their own
    before = block.outputs(x, h)
    for got, want in zip(before, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert reorder_pending(block, limit=1, gemms_only=True)  # nothing that speeds GEMMs
    assert len(block.pending_reorders) == 3
    assert not reorder_pending(block)
    for got, want, undeferred in zip(block.outputs(x, h), before, packed.outputs(x, h)):
        assert torch.equal(got, want) and torch.equal(got, undeferred)


def test_tied_lm_head_keeps_the_embedding_weight() -> None:
    block = Block()
    block.lm_head.keeps_weight = True
    before = block.lm_head.weight.detach().clone()
    prepare_linear_weights(block, "auto", "fp16")
    torch.testing.assert_close(block.lm_head.weight, before)


def test_torch_backend_leaves_the_weights_alone() -> None:
    block = Block()
    assert prepare_linear_weights(block, "torch") == "torch"
    assert block.col.weight.shape == (24, 48)
    assert getattr(block.col, "linear_kind", None) is None


def test_unknown_backend_or_quantization_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="cpu linear backend"):
        prepare_linear_weights(Block(), "mkl")
    with pytest.raises(ValueError, match="quantization must be one of"):
        prepare_linear_weights(Block(), "auto", "int3")
    with pytest.raises(ValueError, match="dtype float32"):
        prepare_linear_weights(Block().to(torch.bfloat16), "auto", "int8")


@pytest.fixture(scope="module")
def smollm2_logprobs() -> dict[str, tuple[float, list[float]]]:
    """Perplexity and per-token logprobs of the built-in passage on SmolLM2, per path."""
    from rvllm import LLM
    from rvllm.bench.perplexity import TEXT, perplexity_of
    from rvllm.sampling_params import SamplingParams

    results = {}
    for name, kwargs in {"torch": {"cpu_linear_backend": "torch", "quantization": "none"},
                         "onednn": {"quantization": "none"},
                         "fp16": {"quantization": "fp16"},
                         "int8": {"quantization": "int8"}, "packed": {}}.items():
        llm = LLM(**kwargs)
        ids = llm.get_tokenizer().encode(TEXT)[:200]
        ppl, _ = perplexity_of(llm, ids, 256)
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=0,
                                                                     prompt_logprobs=0))[0]
        logprobs = [e[t].logprob for t, e in zip(ids[1:], out.prompt_logprobs[1:])]
        results[name] = (ppl, logprobs)
        llm.engine.shutdown()
    return results


@needs_onednn
@needs_fbgemm
def test_smollm2_accuracy_of_each_linear_path(smollm2_logprobs) -> None:
    """The stated tolerances: oneDNN float32 and fp16 weights score the text like plain
    float32 (perplexity within 0.1% and 1%); int8 weights within 1% (their activations
    quantized to 16 bits by kernels.cpu.int8_gemm: 35.03 against 35.04; fbgemm's 7-bit
    activations, without numba, gave 39.2); the file's Q4_1 blocks packed, by
    activations rounded to 16-bit integers a block, within 0.1% and 5e-3 a token."""
    ref_ppl, ref = smollm2_logprobs["torch"]
    limits = {"onednn": (1.001, 1e-3), "fp16": (1.01, 0.05), "int8": (1.01, None),
              "packed": (1.001, 5e-3)}
    for name, (ppl_ratio, max_diff) in limits.items():
        ppl, logprobs = smollm2_logprobs[name]
        assert math.exp(abs(math.log(ppl / ref_ppl))) < ppl_ratio, (name, ppl, ref_ppl)
        if max_diff is not None:
            assert max(abs(a - b) for a, b in zip(logprobs, ref)) < max_diff, name


@pytest.mark.parametrize("parts", [1, 2, 3])
@pytest.mark.parametrize("rows", [1, 3, 6])
@pytest.mark.parametrize("int8", [False, True])
def test_panel_gemv_kernels_equal_their_torch_reference(parts: int, rows: int,
                                                        int8: bool) -> None:
    """The GEMV (``gemv._matvec``) and the fused gate/up/SiLU
    (``step_parts._gate_up_silu``) read the weight in panels of 16 rows, shared out
    among the threads, up to four rows of x a pass: every split of the panels, weights
    whose last panel is partly padding, odd column counts and more rows of x than a pass
    takes must give F.linear's numbers, with and without scales and biases."""
    from rvllm.kernels.cpu.gemv import _matvec, panels
    from rvllm.kernels.cpu.step_parts import _gate_up_silu

    gen = torch.Generator().manual_seed(parts * 10 + rows)
    empty = torch.empty(0).numpy()
    for n, k in ((5, 40), (16, 41), (48, 40), (67, 7), (130, 40), (160, 24)):
        x = torch.randn(rows, k, generator=gen)
        if int8:
            q = torch.randint(-127, 128, (2 * n, k), generator=gen, dtype=torch.int8)
            scale = torch.rand(2 * n, generator=gen) / 50
            packed, dense = panels(q, scale), q.float() * scale[:, None]
        else:
            dense = torch.randn(2 * n, k, generator=gen)
            packed = panels(dense)
        bias = torch.randn(2 * n, generator=gen)
        for b in (None, bias):
            out = torch.empty(rows, 2 * n)
            _matvec(x.numpy(), packed.weight, packed.scale,
                    empty if b is None else b.numpy(), out.numpy(), parts)
            torch.testing.assert_close(out, F.linear(x, dense, b), rtol=1e-5, atol=1e-4)
            if n % 16:
                continue  # the fused gate/up takes whole panels of each
            act = torch.empty(rows, n)
            _gate_up_silu(x.numpy(), packed.weight, packed.scale,
                          empty if b is None else b.numpy(), act.numpy(), parts)
            gate, up = F.linear(x, dense, b).chunk(2, dim=-1)
            torch.testing.assert_close(act, F.silu(gate) * up, rtol=1e-5, atol=1e-4)
