"""The decode steps in numba against the torch layers they replace and against
transformers: the one-call step of a few rows (kernels/cpu/decoder_step.py) and the
batch step of more (kernels/cpu/batch_step.py); float32 and int8 weights, GQA, Qwen2's
biases, Mistral's sliding window, and the models they must leave to the layers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import hf_greedy

from rvllm import LLM, SamplingParams

# rvllm.kernels is imported inside the tests: test_kernels.py must be first to import it
# (it sets TRITON_INTERPRET=1 before), and pytest imports every test module up front.


def build_plan(decoder):  # noqa: ANN001, ANN201
    """The decoder's compiled-step plan, made afresh (None where the kernels do not
    compute its stack)."""
    decoder.__dict__.pop("_decoder_step_plan", None)
    return decoder.step_plan()

PROMPTS = [[5, 6, 7], [11, 3, 99, 42, 8, 17, 250, 31, 64, 2, 77, 19, 5, 5, 300, 12, 40, 41]]
NEW_TOKENS = 40  # past Mistral's 24-token window in the test models


def generate(llm: LLM, prompt: list[int], fused: bool) -> tuple[list[int], float]:
    """Greedy tokens and their cumulative logprob, one sequence at a time (every decode
    step has one row), with the fused step or the torch layers."""
    decoder = llm.engine.model.model
    if not fused:
        decoder._decoder_step_plan = None
    else:
        decoder.__dict__.pop("_decoder_step_plan", None)  # built again on first use
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    out = llm.generate([prompt], params)[0].outputs[0]
    return out.token_ids, out.cumulative_logprob


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_fused_step_matches_transformers_and_the_layers(model_dirs: dict[str, Path],
                                                        arch: str) -> None:
    llm = LLM(str(model_dirs[arch]), kernel_backend="numba", block_size=8)
    assert build_plan(llm.engine.model.model) is not None
    want = hf_greedy(model_dirs[arch], PROMPTS, NEW_TOKENS)
    for prompt, expected in zip(PROMPTS, want):
        tokens, logprob = generate(llm, prompt, fused=True)
        plan = llm.engine.model.model._decoder_step_plan
        assert plan is not None and plan.caches() is not None  # it did run
        assert plan._logits is not None  # through to the logits (the runner's decode path)
        assert tokens == expected
        layer_tokens, layer_logprob = generate(llm, prompt, fused=False)
        assert layer_tokens == tokens
        assert logprob == pytest.approx(layer_logprob, abs=1e-3)


def test_fused_step_with_int8_weights_matches_the_int8_layers(llama_dir: Path) -> None:
    # No prefix cache: int8 prefills quantize activations over the whole chunk, so a
    # prefix hit (a shorter chunk) would change the prompt's K/V by ~1e-3.
    llm = LLM(str(llama_dir), kernel_backend="numba", quantization="int8",
              enable_prefix_caching=False)
    for prompt in PROMPTS:
        tokens, logprob = generate(llm, prompt, fused=True)
        plan = llm.engine.model.model._decoder_step_plan
        assert plan is not None and plan.caches() is not None
        layer_tokens, layer_logprob = generate(llm, prompt, fused=False)
        assert tokens == layer_tokens
        # The prompt's int8 prefill (the batch step's) rounds in another order than the
        # layers', so an activation may land on the next int8 step: close, not equal.
        assert logprob == pytest.approx(layer_logprob, rel=1e-3)


def _decode_inputs(llm: LLM, prompts: list[list[int]], bs: int):
    """Prefill ``prompts`` in the engine, then the metadata and inputs of their next
    decode step (token 9 each), built the way the model runner builds them."""
    from rvllm.forward_context import AttentionMetadata

    engine = llm.engine
    for prompt in prompts:
        engine.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=4))
    engine.step()  # the prefills: the prompts' K/V are in the cache
    seqs = [r.seqs[0] for r in engine.requests.values()]
    positions = torch.tensor([s.num_computed_tokens for s in seqs])
    width = max(len(s.block_table) for s in seqs)
    tables = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        tables[i, :len(s.block_table)] = torch.tensor(s.block_table)
    slots = torch.stack([tables[i, p // bs] * bs + p % bs for i, p in enumerate(positions)])

    def metadata(rows: list[int]) -> AttentionMetadata:
        pos = torch.arange(int(positions[rows].max()) + 1)
        gather = tables[rows][:, pos // bs] * bs + pos % bs
        return AttentionMetadata(slots[rows], len(rows), gather, positions[rows] + 1, [],
                                 decode_block_tables=tables[rows])
    return metadata, torch.full((len(seqs),), 9), positions


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_hidden_states_match_the_layers_and_each_row_alone(llama_dir: Path,
                                                           quantization: str | None) -> None:
    """One step's final hidden states from the same cache: the fused step for three
    sequences, for each alone, and (float32) the layers."""
    from rvllm.forward_context import set_forward_context

    llm = LLM(str(llama_dir), kernel_backend="numba", block_size=8,
              quantization=quantization)
    decoder = llm.engine.model.model
    plan = build_plan(decoder)
    assert plan is not None and plan.max_rows == (4 if quantization else 8)
    assert plan.caches() is not None  # one stacked allocation: the fused step can run
    metadata, ids, positions = _decode_inputs(llm, [PROMPTS[0], PROMPTS[1], [7, 8, 9, 10]], 8)

    def run(rows: list[int], fused: bool) -> torch.Tensor:
        decoder._decoder_step_plan = plan if fused else None
        with torch.inference_mode(), set_forward_context(metadata(rows)):
            return decoder(ids[rows], positions[rows])

    together = run([0, 1, 2], fused=True)
    alone = torch.cat([run([i], fused=True) for i in range(3)])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)
    if quantization is None:  # int8 layers quantize a batch's activations; this does not
        torch.testing.assert_close(together, run([0, 1, 2], fused=False), atol=1e-5,
                                   rtol=1e-5)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_decode_logits_match_the_layers_logits_and_their_greedy_token(
        llama_dir: Path, quantization: str | None) -> None:
    """The runner's compiled decode (``CausalLM.decode_logits``: the step, the LM head and
    the greedy token in two calls) against the fused step's hidden states through
    ``compute_logits`` and the sampler's argmax and log-softmax; three rows and one."""
    from rvllm.forward_context import set_forward_context

    llm = LLM(str(llama_dir), kernel_backend="numba", block_size=8,
              quantization=quantization)
    model = llm.engine.model
    metadata, ids, positions = _decode_inputs(llm, [PROMPTS[0], PROMPTS[1], [7, 8, 9, 10]], 8)
    for rows in ([0, 1, 2], [1]):
        md = metadata(rows)
        with torch.inference_mode(), set_forward_context(md):
            hidden = model(ids[rows], positions[rows])
            want = model.compute_logits(hidden)
        if quantization:  # fbgemm quantizes the rows too: the kernels take them as they are
            head = model.lm_head.panel_weight
            dense = torch.from_numpy(head.weight).permute(0, 2, 1).reshape(-1, hidden.shape[1])
            want = hidden @ (dense[:head.rows].float() * torch.from_numpy(head.scale)[:, None]).T
        args = (ids[rows].numpy(), positions[rows].numpy(), md.slot_mapping.numpy(),
                md.decode_block_tables.numpy())
        plain = model.decode_logits(*args, greedy=False)
        assert plain is not None and plain.greedy is None
        torch.testing.assert_close(plain.logits, want, atol=1e-4, rtol=1e-4)
        got = model.decode_logits(*args, greedy=True)
        torch.testing.assert_close(got.logits, want, atol=1e-4, rtol=1e-4)
        tokens, logprobs = got.greedy
        assert tokens == got.logits.argmax(dim=-1).tolist()
        picked = torch.log_softmax(got.logits, dim=-1)[range(len(rows)), tokens]
        torch.testing.assert_close(torch.tensor(logprobs), picked, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_head_greedy_merges_the_threads_shares_as_one_argmax(parts: int) -> None:
    """The LM head's greedy pass: each thread's share of the vocabulary (some empty, at
    5 parts of 3 panels) gives its largest logit, where it first is and its sum of exps;
    merged, the first index of the row's largest logit (ties too, as torch.argmax) and
    its log-softmax."""
    import numpy as np

    from rvllm.kernels.cpu.gemv import panels
    from rvllm.kernels.cpu.step_parts import _head_greedy

    gen = torch.Generator().manual_seed(parts)
    for vocab in (5, 40, 100):
        weight = torch.randn(vocab, 24, generator=gen)
        weight[vocab - 1] = weight[vocab // 3]  # a tie for the top at two indices
        x = torch.randn(3, 24, generator=gen)
        x[1] = weight[vocab // 3] * 3  # row 1's top is that tie
        want = x @ weight.T
        logits = np.empty((3, vocab), np.float32)
        ids, logprobs = np.empty(3, np.int64), np.empty(3, np.float32)
        packed = panels(weight)
        _head_greedy(x.numpy(), packed.weight, packed.scale, logits, ids, logprobs, parts)
        torch.testing.assert_close(torch.from_numpy(logits), want, atol=1e-4, rtol=1e-4)
        assert ids.tolist() == torch.from_numpy(logits).argmax(dim=-1).tolist()
        assert ids[1] == vocab // 3
        picked = torch.log_softmax(torch.from_numpy(logits), -1)[range(3), ids.tolist()]
        torch.testing.assert_close(torch.from_numpy(logprobs), picked, atol=1e-5, rtol=1e-5)


# More rows than the one-call step takes (8 float32, 4 int8): the batch step runs.
BATCH = [[3 + i, 40 + 7 * i, 9] + list(range(11, 11 + i)) for i in range(10)]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_batch_step_matches_transformers_and_the_layers(model_dirs: dict[str, Path],
                                                        arch: str) -> None:
    llm = LLM(str(model_dirs[arch]), kernel_backend="numba", block_size=8)
    decoder = llm.engine.model.model
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    calls = []
    from rvllm.models import cpu_step

    def counted(*args):  # noqa: ANN002, ANN202
        calls.append(args[1].shape[0])
        return batch_step(*args)

    batch_step, cpu_step.batch_step = cpu_step.batch_step, counted
    try:
        outs = llm.generate(BATCH, params)
    finally:
        cpu_step.batch_step = batch_step
    # It ran the prompts' prefill (all their tokens) and decode steps of every row.
    assert sum(map(len, BATCH)) in calls and len(BATCH) in calls
    want = hf_greedy(model_dirs[arch], BATCH, NEW_TOKENS)
    assert [o.outputs[0].token_ids for o in outs] == want
    decoder._decoder_step_plan = None  # the layers
    layers = llm.generate(BATCH, params)
    for out, ref in zip(outs, layers):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.outputs[0].cumulative_logprob == pytest.approx(
            ref.outputs[0].cumulative_logprob, abs=1e-3)


def test_batch_step_hidden_states_match_the_layers(llama_dir: Path) -> None:
    """One step of ten sequences from the same cache, through the batch step and through
    the layers: float32 to rounding; int8 (whose layers scale each row the same way, but
    round in another order, so an activation may land on the next int8 step) as far from
    float32 as the int8 layers are."""
    from rvllm.forward_context import set_forward_context

    hidden = {}
    for quantization in (None, "int8"):
        llm = LLM(str(llama_dir), kernel_backend="numba", block_size=8,
                  quantization=quantization)
        decoder = llm.engine.model.model
        plan = build_plan(decoder)
        assert plan is not None and plan.caches() is not None
        metadata, ids, positions = _decode_inputs(llm, BATCH, 8)
        for fused in (True, False):
            decoder._decoder_step_plan = plan if fused else None
            with torch.inference_mode(), set_forward_context(metadata(list(range(len(BATCH))))):
                hidden[quantization, fused] = decoder(ids, positions)
    reference = hidden[None, False]
    torch.testing.assert_close(hidden[None, True], reference, atol=1e-5, rtol=1e-5)
    layers_error = (hidden["int8", False] - reference).abs().max()
    assert 0 < layers_error < 0.5
    assert (hidden["int8", True] - reference).abs().max() <= 1.25 * layers_error


def test_other_shapes_keep_the_layers(model_dirs: dict[str, Path]) -> None:
    llm = LLM(str(model_dirs["llama"]), kernel_backend="numba", cpu_linear_backend="torch")
    assert build_plan(llm.engine.model.model) is None  # no weight panels



@pytest.mark.parametrize("parts", [1, 3, 5])
def test_step_gives_the_same_logits_whatever_its_count_of_work_items(llama_dir: Path,
                                                                     parts: int) -> None:
    """The compiled step runs in one parallel region whose work items are claimed by
    whichever thread is free (``kernels/cpu/sync.py``). With one region iteration, or
    more than numba has threads (some then run one after another on a thread), it ends,
    and gives the logits and greedy tokens of numba's own count; three rows (in the
    region, as packed weights' steps of a few rows run) and one."""
    import numba
    import numpy as np

    from rvllm.kernels.cpu import decoder_step as step

    llm = LLM(str(llama_dir), kernel_backend="numba", block_size=8)
    model = llm.engine.model
    metadata, ids, positions = _decode_inputs(llm, [PROMPTS[0], PROMPTS[1], [7, 8, 9, 10]], 8)
    plan = build_plan(model.model)
    head = plan.head(model.lm_head)
    for rows in ([0, 1, 2], [1]):
        md = metadata(rows)

        def run(count: int, rows: list[int] = rows, md=md) -> tuple:  # noqa: ANN001
            logits = np.empty((len(rows), head.rows), np.float32)
            tokens, logprobs = np.empty(len(rows), np.int64), np.empty(len(rows), np.float32)
            step._step_to_logits(
                plan.arrays.embedding.numpy(), ids[rows].numpy(),
                *step._layer_args(plan.arrays, plan.caches(), md.decode_block_tables.numpy(),
                                  positions[rows].numpy(), md.slot_mapping.numpy()),
                head.weight, head.scale, logits, tokens, logprobs, count, len(rows))
            return logits, tokens.tolist(), logprobs

        want_logits, want_tokens, want_logprobs = run(numba.get_num_threads())
        logits, tokens, logprobs = run(parts)
        np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
        assert tokens == want_tokens
        np.testing.assert_allclose(logprobs, want_logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_a_gemvs_work_items_cover_its_panels_once_in_order(parts: int) -> None:
    """A GEMV in the one-region step is one first share per thread, then short runs of
    its last panels (``decoder_step._item_panels``), of two panels at least but the
    last: together every panel once, in order, the first shares near-equal, whatever the
    count of panels."""
    from rvllm.kernels.cpu.decoder_step import PAIR, TAIL, _item_panels, _items

    for n in (0, 1, 5, 7, 8, 36, 60, 96, 3072):
        ranges = [_item_panels(n, item, parts) for item in range(_items(n, parts))]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
        assert all(lo <= hi for lo, hi in ranges)
        first = [hi - lo for lo, hi in ranges[:parts]]
        assert max(first) - min(first) <= 1
        if parts > 1:
            assert sum(first) == n - n // TAIL
        assert all(hi - lo >= PAIR for lo, hi in ranges[parts:-1])  # two streams each


def test_the_step_trace_script_still_instruments_the_one_region_step() -> None:
    """``benchmarks/trace_n1_step.py`` reads the cycle counter after lines of
    ``_one_region`` that it names: when those lines change, the script must fail to
    instrument (and say so) or instrument every point, never trace something else."""
    import importlib.util

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("trace_n1_step",
                                                  root / "benchmarks" / "trace_n1_step.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    traced = script.instrument((root / script.STEP_SOURCE).read_text())
    compile(traced, str(script.STEP_SOURCE), "exec")
    region = traced[traced.index("def _one_region("):traced.index("def _by_op(")]
    reads = [f"trace[th, layer, {point}] = _cycles()" for point in range(len(script.POINTS))]
    assert [region.index(read) for read in reads] == sorted(region.index(r) for r in reads)
    assert "trace[th, layers, 0]" in region and "trace[th, layers, 1]" in region
    assert len(script.SEGMENTS) == len(script.POINTS) - 1


NAN_STEP = """
import sys
from rvllm import LLM, SamplingParams
engine = LLM(sys.argv[1], kernel_backend="numba").engine
engine.add_request("r", {"prompt_token_ids": [5, 6, 7]},
                   SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
engine.step()  # the prefill
engine.model.model.layers[0].self_attn.o_proj.panel_weight.weight[...] = float("nan")
print(engine.step()[0].outputs[0].token_ids)
"""


def test_a_one_row_step_that_meets_nan_ends(llama_dir: Path) -> None:
    """A division by zero in the one-region step (NaN activations: a broken weight) gave
    an exception on one thread while the other waited for its share forever: a hung
    engine. The region computes in numpy's error model (no exceptions), so the step ends;
    a row of NaN logits gives token 0, as ``torch.argmax`` does."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", NAN_STEP, str(llama_dir)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1].endswith(", 0]")
