"""Specification of the sampler: the batched device layer and the public CPU API."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rvllm.layers.sampler import (
    Sampler,
    SamplingRow,
    compute_prompt_logprobs,
    plain_greedy,
    process_logits,
)
from rvllm.sampler import Sampler as CpuSampler
from rvllm.sampler import apply_penalties, sample_batch
from rvllm.sampling_params import SamplingParams

# probs 0.5, 0.3, 0.15, 0.05: every filter below has an unambiguous answer on it.
CRAFTED_PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
CRAFTED_LOGITS = CRAFTED_PROBS.log()


def row(
    params: SamplingParams | None = None,
    prompt: tuple[int, ...] = (),
    output: tuple[int, ...] = (),
) -> SamplingRow:
    """A SamplingRow whose generator follows params.seed, as the engine builds it."""
    params = params or SamplingParams()
    gen = None if params.seed is None else torch.Generator().manual_seed(params.seed)
    return SamplingRow(params, prompt, output, gen)


def sample_many(params: SamplingParams, logits: torch.Tensor, n: int) -> torch.Tensor:
    """Sample ``n`` times from ``logits`` [V] in one batched call."""
    torch.manual_seed(0)
    out = Sampler()(logits.expand(n, -1), [row(params) for _ in range(n)])
    return torch.tensor(out.sampled_token_ids)


def test_greedy_equals_argmax_of_logits() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    out = Sampler()(logits, [row(SamplingParams(temperature=0.0)) for _ in range(6)])
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("kernel_backend", ["numba"], indirect=True)
def test_numba_greedy_matches_argmax_and_log_softmax(kernel_backend: str) -> None:
    """The CPU's one-kernel greedy path (kernels/cpu/greedy.py) against torch: the first
    index of a tied max, as torch.argmax, and the log-softmax of the chosen token."""
    logits = torch.randn(5, 3000, generator=torch.Generator().manual_seed(5)) * 4
    logits[1, 7] = logits[1, 2900] = logits[1].max() + 1  # a tie: the first wins
    logits[2] = 0.5  # all tied
    logits[3, 100:] = -1e30  # far below the max: exp underflows to nothing
    out = Sampler()(logits, [row(SamplingParams(temperature=0.0)) for _ in range(5)])
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()
    assert out.sampled_token_ids[1:3] == [7, 0]
    want = logits.log_softmax(dim=-1).gather(1, logits.argmax(dim=-1, keepdim=True))
    np.testing.assert_allclose(out.sampled_logprobs, want.squeeze(1).tolist(), atol=1e-5)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0, logprobs=2),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=0, logit_bias={3: 1.0}),
    SamplingParams(temperature=0, min_tokens=2),
    SamplingParams(temperature=0, min_tokens=2, ignore_eos=True, stop_token_ids=[4]),
    SamplingParams(temperature=0, repetition_penalty=1.2),
    SamplingParams(temperature=0, presence_penalty=0.5),
])
@pytest.mark.parametrize("num_output_tokens", [0, 3])
def test_plain_greedy_rows_are_those_the_sampler_takes_the_raw_argmax_of(
        params: SamplingParams, num_output_tokens: int) -> None:
    """The compiled CPU decode skips the sampler for ``plain_greedy`` rows: exactly those
    whose logits ``process_logits`` leaves as they are, greedy and without logprobs."""
    raw = torch.randn(1, 10)
    row = SamplingRow(params, [1, 2], list(range(5, 5 + num_output_tokens)), None)
    untouched = process_logits(raw, [row]) is raw
    assert plain_greedy(params, num_output_tokens) == (
        untouched and params.is_greedy and params.logprobs is None)


def test_greedy_on_bf16_logits_equals_argmax_in_float32() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2)).bfloat16()
    out = Sampler()(logits, [row(SamplingParams(temperature=0.0)) for _ in range(4)])
    assert out.sampled_token_ids == logits.float().argmax(dim=-1).tolist()


def test_greedy_rows_in_a_mixed_batch_take_argmax() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    greedy, rand = SamplingParams(temperature=0.0), SamplingParams(temperature=1.5)
    out = Sampler()(logits, [row(rand), row(greedy), row(rand), row(greedy)])
    argmax = logits.argmax(dim=-1).tolist()
    assert [out.sampled_token_ids[1], out.sampled_token_ids[3]] == [argmax[1], argmax[3]]


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0])
def test_top_k_1_equals_greedy_at_any_temperature(temperature: float) -> None:
    logits = torch.randn(32, 100, generator=torch.Generator().manual_seed(4))
    params = SamplingParams(temperature=temperature, top_k=1)
    out = Sampler()(logits, [row(params) for _ in range(32)])
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.75), {0, 1}),  # 0.5 + 0.3 is the smallest set >= 0.75
        (SamplingParams(top_p=0.01), {0}),  # the top token is always kept
        (SamplingParams(min_p=0.2), {0, 1, 2}),  # 0.05 < 0.2 * 0.5
        (SamplingParams(top_k=3, min_p=0.35), {0, 1}),  # 0.15 < 0.35 * 0.5
    ],
    ids=["top_k", "top_p", "top_p_tiny", "min_p", "top_k_and_min_p"],
)
def test_filters_never_sample_a_filtered_token(params: SamplingParams, allowed: set[int]) -> None:
    drawn = set(sample_many(params, CRAFTED_LOGITS, 4000).tolist())
    assert drawn == allowed


def test_filters_apply_per_row_within_one_batch() -> None:
    torch.manual_seed(0)
    params = [SamplingParams(top_k=1), SamplingParams(top_p=0.75), SamplingParams(min_p=0.2)]
    rows = [row(params[i % 3]) for i in range(3000)]
    out = Sampler()(CRAFTED_LOGITS.expand(3000, -1), rows)
    tokens = torch.tensor(out.sampled_token_ids).view(-1, 3)
    assert [set(tokens[:, j].tolist()) for j in range(3)] == [{0}, {0, 1}, {0, 1, 2}]


def test_sampling_frequencies_match_softmax() -> None:
    logits = torch.tensor([1.0, 0.0, -0.5, 0.5])
    n = 20_000
    tokens = sample_many(SamplingParams(temperature=1.0), logits, n)
    freqs = torch.bincount(tokens, minlength=4).float() / n
    # 5 sigma of a binomial frequency at n = 20k is under 0.02.
    torch.testing.assert_close(freqs, logits.softmax(-1), atol=0.02, rtol=0)


def test_temperature_sharpens_sampling_frequencies() -> None:
    logits = torch.tensor([1.0, 0.0, -0.5, 0.5])
    n = 20_000
    tokens = sample_many(SamplingParams(temperature=0.5), logits, n)
    freqs = torch.bincount(tokens, minlength=4).float() / n
    torch.testing.assert_close(freqs, (logits / 0.5).softmax(-1), atol=0.02, rtol=0)


def run_steps(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow], steps: int) -> list:
    return [sampler(logits, rows).sampled_token_ids for _ in range(steps)]


def test_seeded_row_gives_same_tokens_alone_and_in_any_batch() -> None:
    vocab = 500
    gen = torch.Generator().manual_seed(5)
    mine = torch.randn(vocab, generator=gen)
    others = torch.randn(4, vocab, generator=gen)
    plain = SamplingParams(temperature=0.9, seed=1234)
    filtered = SamplingParams(temperature=1.2, top_p=0.9, seed=99)
    sampler = Sampler()

    def alone(params: SamplingParams) -> list[int]:
        steps = run_steps(sampler, mine.unsqueeze(0), [row(params)], 8)
        return [s[0] for s in steps]

    batch_rows = [
        row(SamplingParams(temperature=0.7)),  # unseeded random
        row(plain),
        row(SamplingParams(temperature=0.0)),  # greedy
        row(SamplingParams(top_k=5, min_p=0.1, seed=7)),  # another seeded row, sorted path
        row(filtered),
        row(SamplingParams(repetition_penalty=1.3), output=(1, 2)),
    ]
    logits = torch.cat([others[:1], mine[None], others[1:3], mine[None], others[3:]])
    steps = run_steps(sampler, logits, batch_rows, 8)
    assert [s[1] for s in steps] == alone(plain)
    assert [s[4] for s in steps] == alone(filtered)


def test_seeded_row_draws_once_per_step_from_its_own_generator() -> None:
    params = SamplingParams(seed=42)
    r = row(params)
    Sampler()(torch.randn(2, 64), [row(SamplingParams(temperature=0.0)), r])
    expected = torch.Generator().manual_seed(42)
    torch.rand(64, generator=expected)  # the V uniforms behind its exponential draws
    assert torch.equal(r.generator.get_state(), expected.get_state())


def reference_penalties(
    logits: list[float],
    prompt: list[int],
    output: list[int],
    repetition: float,
    frequency: float,
    presence: float,
) -> list[float]:
    """vLLM's penalties, one token at a time in plain Python."""
    result = []
    for token, x in enumerate(logits):
        if token in prompt or token in output:
            x = x / repetition if x > 0 else x * repetition
        count = output.count(token)
        x -= frequency * count
        x -= presence * (count > 0)
        result.append(x)
    return result


@pytest.mark.parametrize(
    ("repetition", "frequency", "presence"),
    [(1.5, 0.0, 0.0), (1.0, 0.7, 0.0), (1.0, 0.0, -1.2), (0.8, -0.4, 0.9)],
    ids=["repetition", "frequency", "presence", "all"],
)
def test_penalties_match_plain_python_reference(
    repetition: float, frequency: float, presence: float
) -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(6))
    prompts, outputs = [[1, 2, 3], [], [5, 5]], [[3, 3, 7], [0, 19, 19, 19], []]
    params = SamplingParams(
        temperature=0.0,
        repetition_penalty=repetition,
        frequency_penalty=frequency,
        presence_penalty=presence,
    )
    rows = [row(params, tuple(p), tuple(o)) for p, o in zip(prompts, outputs)]
    processed = process_logits(logits, rows)
    for i in range(3):
        expected = reference_penalties(
            logits[i].tolist(), prompts[i], outputs[i], repetition, frequency, presence
        )
        torch.testing.assert_close(processed[i], torch.tensor(expected))


def test_penalties_leave_rows_that_did_not_ask_untouched() -> None:
    logits = torch.randn(2, 10)
    rows = [row(output=(1, 1, 2)), row(SamplingParams(frequency_penalty=1.0), output=(1,))]
    processed = process_logits(logits, rows)
    assert torch.equal(processed[0], logits[0])
    assert processed[1, 1] == logits[1, 1] - 1.0


def test_logit_bias_is_added_before_sampling() -> None:
    logits = torch.zeros(2, 10)
    rows = [
        row(SamplingParams(temperature=0.0, logit_bias={7: 5.0})),
        row(SamplingParams(logit_bias={3: 100.0})),  # forces token 3 even when sampling
    ]
    assert Sampler()(logits, rows).sampled_token_ids == [7, 3]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 9] = 50.0  # EOS is by far the most likely token
    logits[0, 8] = 40.0  # then the stop token
    params = SamplingParams(min_tokens=3, stop_token_ids=[8], eos_token_ids=frozenset({9}))
    torch.manual_seed(0)
    before = [Sampler()(logits, [row(params, output=(1,) * n)]) for n in range(3)]
    for out in before:
        assert out.sampled_token_ids[0] not in (8, 9)
    after = Sampler()(logits, [row(params, output=(1, 1, 1))])
    assert after.sampled_token_ids == [9]


def test_min_tokens_with_ignore_eos_masks_only_stop_tokens() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 9], logits[0, 8] = 50.0, 60.0
    params = SamplingParams(
        temperature=0.0,
        min_tokens=2,
        stop_token_ids=[8],
        ignore_eos=True,
        eos_token_ids=frozenset({9}),
    )
    assert Sampler()(logits, [row(params)]).sampled_token_ids == [9]


def test_sampled_logprobs_are_log_softmax_of_raw_logits() -> None:
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(8))
    # Penalties, bias and temperature change the pick but never the reported logprob.
    params = SamplingParams(temperature=0.5, repetition_penalty=2.0, logit_bias={4: 3.0})
    out = Sampler()(logits, [row(params, output=(1, 2)) for _ in range(3)])
    expected = logits.log_softmax(-1).gather(1, torch.tensor(out.sampled_token_ids)[:, None])
    torch.testing.assert_close(torch.tensor(out.sampled_logprobs), expected.squeeze(1))


def test_top_logprobs_are_raw_log_softmax_sorted_with_k_per_row() -> None:
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(9))
    ks = [5, None, 0]
    rows = [row(SamplingParams(temperature=0.0, logprobs=k)) for k in ks]
    out = Sampler()(logits, rows)
    assert out.top_logprob_ids is not None and out.top_logprobs is not None
    assert [len(ids) for ids in out.top_logprob_ids] == [5, 0, 0]
    ref_vals, ref_ids = logits[0].log_softmax(-1).sort(descending=True)
    assert out.top_logprob_ids[0] == ref_ids[:5].tolist()
    torch.testing.assert_close(torch.tensor(out.top_logprobs[0]), ref_vals[:5])


def test_no_top_logprobs_when_no_row_asks() -> None:
    out = Sampler()(torch.randn(2, 10), [row(), row()])
    assert out.top_logprob_ids is None and out.top_logprobs is None


def test_prompt_logprobs_are_raw_log_softmax_of_next_tokens() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(10)).half()
    next_ids = torch.tensor([3, 0, 29, 7])
    token_lp, top_ids, top_lp = compute_prompt_logprobs(logits, next_ids, k=2)
    ref = logits.float().log_softmax(-1)
    torch.testing.assert_close(torch.tensor(token_lp), ref.gather(1, next_ids[:, None])[:, 0])
    ref_vals, ref_ids = ref.topk(2, dim=-1)
    assert top_ids == ref_ids.tolist()
    torch.testing.assert_close(torch.tensor(top_lp), ref_vals)


# --- public CPU API ---------------------------------------------------------------


@pytest.mark.parametrize("to_input", [list, np.array, torch.tensor], ids=["list", "numpy", "torch"])
def test_cpu_sample_accepts_lists_arrays_and_tensors(to_input) -> None:
    logits = [0.1, 3.0, -1.0, 0.5]
    assert CpuSampler().sample(to_input(logits), temperature=0.0) == 1


def test_cpu_sample_batch_row_i_equals_sample_with_seed_plus_i() -> None:
    logits = np.random.default_rng(11).normal(size=(5, 200)).astype(np.float32)
    kwargs = {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "min_p": 0.01}
    batch = sample_batch(logits, seed=100, **kwargs)
    single = [CpuSampler().sample(logits[i], seed=100 + i, **kwargs) for i in range(5)]
    assert batch == single


def test_cpu_seeded_sample_is_reproducible_and_seed_dependent() -> None:
    logits = torch.zeros(1000)  # uniform: distinct seeds almost surely differ
    sampler = CpuSampler()
    draws = [sampler.sample(logits, seed=s) for s in (1, 1, 2, 3)]
    assert draws[0] == draws[1]
    assert len(set(draws[1:])) == 3


def test_cpu_apply_penalties_matches_reference_and_keeps_input_kind() -> None:
    logits = np.random.default_rng(12).normal(size=20).astype(np.float32)
    token_ids = [1, 1, 4, 19]
    got = apply_penalties(
        logits, token_ids, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2
    )
    expected = reference_penalties(logits.tolist(), [], token_ids, 1.3, 0.5, 0.2)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    assert isinstance(apply_penalties(logits.tolist(), token_ids), list)


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: CpuSampler().sample([0.0, 1.0], temperature=-1.0), "temperature"),
        (lambda: CpuSampler().sample([0.0, 1.0], top_p=0.0), "top_p"),
        (lambda: CpuSampler().sample([0.0, 1.0], top_k=-3), "top_k"),
        (lambda: CpuSampler().sample([0.0, 1.0], min_p=1.5), "min_p"),
        (lambda: CpuSampler().sample([0.0, 1.0], seed=1.5), "seed"),
        (lambda: CpuSampler().sample([[0.0, 1.0]]), "logits"),
        (lambda: CpuSampler().sample([]), "logits"),
        (lambda: CpuSampler().sample([0.0, float("nan")]), "logits"),
        (lambda: sample_batch([0.0, 1.0]), "logits_batch"),
        (lambda: sample_batch([[0.0, 1.0], [2.0]]), "logits_batch"),
        (lambda: apply_penalties([0.0], [0], repetition_penalty=0.0), "repetition_penalty"),
        (lambda: apply_penalties([0.0], [0], frequency_penalty=3.0), "frequency_penalty"),
        (lambda: apply_penalties([0.0], [0], presence_penalty=-3.0), "presence_penalty"),
        (lambda: apply_penalties([0.0, 1.0], [2]), "token_ids"),
    ],
)
def test_invalid_arguments_raise_value_error_naming_the_field(call, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        call()
