"""Speculative decoding's parts on their own: the n-gram proposer's matching, greedy
verification, rejection sampling's output distribution, and the configuration's checks."""

from __future__ import annotations

import pytest
import torch

from rvllm.spec_decode.config import SpeculativeConfig
from rvllm.spec_decode.ngram import propose_ngram
from rvllm.spec_decode.rejection import rejection_sample, verify_greedy


@pytest.mark.parametrize(("tokens", "k", "lo", "hi", "expected"), [
    ([1, 2, 3, 4, 1, 2], 2, 1, 3, [3, 4]),          # "1 2" seen before: what followed it
    ([1, 2, 3, 4, 1, 2], 5, 1, 3, [3, 4, 1, 2, 3]),  # past the end: period 4 goes on
    ([5, 1, 2, 9, 7, 1, 2, 8, 1, 2], 1, 2, 2, [8]),  # the latest earlier match wins
    ([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 2, 1, 3, [9, 2]),  # the longest n first
    ([1, 2, 3], 3, 1, 3, []),                        # no earlier occurrence
    ([4, 4, 4, 4], 2, 2, 2, [4, 4]),                 # overlapping matches: period 1
    ([7, 5, 6, 5, 6], 4, 2, 2, [5, 6, 5, 6]),        # period 2 from a match 2 back
    ([1, 2, 3, 1], 2, 2, 3, []),                     # below lookup_min: nothing
])
def test_ngram_proposer_matches_by_hand(tokens, k, lo, hi, expected):
    assert propose_ngram(tokens, k, lo, hi) == expected


def test_greedy_verification_keeps_drafts_while_they_equal_the_argmax():
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all kept, plus bonus
    assert verify_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]        # corrected at 2nd
    assert verify_greedy([4, 6, 7, 8], [5, 6, 7]) == [4]
    assert verify_greedy([3], []) == [3]


# Chi-square critical value at p = 0.001 for 5 categories (4 degrees of freedom).
_CHI2_4_DOF_0_001 = 18.47


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("proposer", ["model", "ngram"])
def test_rejection_sampling_reproduces_the_target_distribution(proposer):
    g = torch.Generator().manual_seed(0)
    target = torch.tensor([[0.40, 0.25, 0.15, 0.12, 0.08],
                           [0.10, 0.20, 0.30, 0.25, 0.15]])
    draft_probs = torch.tensor([[0.05, 0.15, 0.50, 0.20, 0.10]])
    first = torch.zeros(5)
    second_after_accept = torch.zeros(5)
    accepted = 0
    draws = 20000
    for _ in range(draws):
        if proposer == "model":
            token = int(torch.multinomial(draft_probs[0], 1, generator=g))
            out = rejection_sample(target, [token], draft_probs, g)
        else:
            token = 2  # a proposer that is sure of its token
            out = rejection_sample(target, [token], None, g)
        first[out[0]] += 1
        if len(out) == 2:
            accepted += 1
            second_after_accept[out[1]] += 1
    assert _chi_square(first, target[0]) < _CHI2_4_DOF_0_001
    assert _chi_square(second_after_accept, target[1]) < _CHI2_4_DOF_0_001
    # The acceptance rate is sum(min(p, q)) for a model draft and p(token) for n-gram.
    rate = float(torch.minimum(target[0], draft_probs[0]).sum()) if proposer == "model" \
        else float(target[0, 2])
    assert abs(accepted / draws - rate) < 0.02


def test_engine_verification_reproduces_the_target_distribution():
    """The engine's check of a sampled row (``verify_drafts``: keep a draft while it
    equals the target's own draw): the first token's distribution is the target's, and so
    is the next one's after the draft is kept; a seeded row's first token is the one the
    sampler draws from the same seed without a draft."""
    from rvllm.layers.sampler import Sampler, SamplingRow, verify_drafts
    from rvllm.sampling_params import SamplingParams

    target = torch.tensor([[0.40, 0.25, 0.15, 0.12, 0.08],
                           [0.10, 0.20, 0.30, 0.25, 0.15]])
    logits = target.log()
    params = SamplingParams(temperature=1.0)
    g = torch.Generator().manual_seed(1)
    first, second = torch.zeros(5), torch.zeros(5)
    draws = 20000
    for _ in range(draws):
        tokens, _ = verify_drafts(logits, [2], params, g)
        first[tokens[0]] += 1
        if len(tokens) == 2:
            second[tokens[1]] += 1
    assert _chi_square(first, target[0]) < _CHI2_4_DOF_0_001
    assert _chi_square(second, target[1]) < _CHI2_4_DOF_0_001
    assert abs(second.sum() / draws - 0.15) < 0.01  # kept with probability p(draft)
    seeded = SamplingParams(temperature=1.0, seed=9)
    for seed in range(20):
        spec, _ = verify_drafts(logits, [2], seeded, torch.Generator().manual_seed(seed))
        plain = Sampler()(logits[:1], [SamplingRow(seeded, [1], [], torch.Generator()
                                                   .manual_seed(seed))])
        assert spec[0] == plain.sampled_token_ids[0]


def test_rejection_sampling_is_reproducible_with_a_seed():
    target = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(1)), -1)
    runs = [rejection_sample(target, [3, 7, 9], None, torch.Generator().manual_seed(5))
            for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize(("value", "message"), [
    ('{"method": "medusa", "num_speculative_tokens": 3}', "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 3, "k": 2}, "no key"),
    ("{not json", "JSON"),
])
def test_bad_speculative_configs_are_refused(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_self_draft_layers_default_to_a_quarter_and_stay_below_the_model():
    config = SpeculativeConfig.parse({"method": "self_draft", "num_speculative_tokens": 2})
    assert config.draft_layers(32) == 8 and config.draft_layers(3) == 1
    too_many = SpeculativeConfig.parse({"method": "self_draft", "num_speculative_tokens": 2,
                                        "num_draft_layers": 4})
    with pytest.raises(ValueError, match="num_draft_layers"):
        too_many.draft_layers(4)
    assert SpeculativeConfig.parse('{"method": "[ngram]", "num_speculative_tokens": 4}'
                                   ).method == "ngram"


# ---------------------------------------------------------------- in the engine

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def _repetitive_prompts() -> list[list[int]]:
    """Prompts that repeat themselves, so prompt lookup finds drafts to verify."""
    g = torch.Generator().manual_seed(4)
    prompts = []
    for n in (3, 5, 8, 13):
        piece = torch.randint(3, 300, (n,), generator=g).tolist()
        prompts.append(piece * 4)
    return prompts


def _generate(llm, prompts, params):
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_ngram_speculation_keeps_greedy_output(model_dirs, arch, backend, monkeypatch):
    from rvllm import LLM, SamplingParams
    from rvllm.executor.model_runner import ModelRunner

    compiled = []
    verify = ModelRunner._compiled_verify_step

    def counted(self, ordered, plan):
        out = verify(self, ordered, plan)
        compiled.append(out is not None)
        return out

    monkeypatch.setattr(ModelRunner, "_compiled_verify_step", counted)

    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = _repetitive_prompts()
    plain = LLM(str(model_dirs[arch]), kernel_backend=backend)
    expected = _generate(plain, prompts, params)
    del plain
    spec = LLM(str(model_dirs[arch]), kernel_backend=backend, speculative_config=NGRAM)
    assert _generate(spec, prompts, params) == expected
    stats = spec.engine.spec_stats
    assert stats.num_accepted_tokens > 0, "the prompts should have given drafts to keep"
    assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    per_pos = stats.accepted_per_pos
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    assert sum(per_pos) == stats.num_accepted_tokens
    bm = spec.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # no block left behind by rejected drafts
    # On the CPU's numba path the drafts are verified in the compiled decode call.
    assert any(compiled) == (backend == "numba")


def _proposers(llama_dir) -> dict[str, dict]:
    """A config of each proposer; the draft model is the target itself, so that every
    greedy draft it makes is kept."""
    return {"ngram": NGRAM,
            "self_draft": {"method": "self_draft", "num_speculative_tokens": 3},
            "draft_model": {"method": "draft_model", "num_speculative_tokens": 3,
                            "model": str(llama_dir)}}


@pytest.mark.parametrize(("method", "mode"), [
    ("ngram", "recompute"), ("ngram", "swap"), ("self_draft", "recompute"),
    ("draft_model", "recompute"), ("draft_model", "swap")])
def test_speculation_beside_other_requests_under_preemption_and_prefix_hits(llama_dir,
                                                                            method, mode):
    """Greedy, greedy with top logprobs, seeded sampling and a penalty (which does not
    speculate) side by side, preempted (by recompute, or to swap space), then again from
    the prefix cache: tokens and logprobs as without speculation, no block left behind."""
    from rvllm import LLM, SamplingParams

    prompts = _repetitive_prompts()
    kinds = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
             SamplingParams(temperature=0.8, seed=11, max_tokens=40, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                            repetition_penalty=1.3)]

    def run(llm):
        engine = llm.engine
        for i, (prompt, params) in enumerate(zip(prompts, kinds)):
            engine.add_request(str(i), prompt, params)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0]
        return [done[str(i)] for i in range(len(prompts))]

    def check(outputs, expected):
        assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
        # Top logprobs of every committed token, kept drafts' included.
        got, want = outputs[1].logprobs, expected[1].logprobs
        assert len(got) == len(want) == 40
        for g, w in zip(got, want):
            assert list(g) == list(w)
            assert [x.logprob for x in g.values()] == pytest.approx(
                [x.logprob for x in w.values()], abs=1e-4)

    roomy = LLM(str(llama_dir))
    expected = run(roomy)
    del roomy
    config = {**_proposers(llama_dir)[method], "disable_by_batch_size": 8}
    tight = LLM(str(llama_dir), speculative_config=config, num_gpu_blocks=14, block_size=8,
                max_model_len=96, max_num_batched_tokens=48, preemption_mode=mode,
                num_cpu_blocks=32 if mode == "swap" else 0)
    check(run(tight), expected)  # the sampled, seeded one included
    assert tight.engine.scheduler.num_preemptions > 0
    check(run(tight), expected)  # again, from the prefix cache
    assert tight.engine.spec_stats.num_accepted_tokens > 0
    bm = tight.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_seeded_sampling_with_speculation_is_reproducible(llama_dir):
    from rvllm import LLM, SamplingParams

    llm = LLM(str(llama_dir), speculative_config=NGRAM)
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=5, n=2, max_tokens=30,
                            ignore_eos=True)
    prompts = _repetitive_prompts()
    assert _generate(llm, prompts, params) == _generate(llm, prompts, params)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("method", ["self_draft", "draft_model"])
def test_model_proposers_keep_greedy_output(model_dirs, arch, method, monkeypatch):
    """Self-draft (the target's first layer) and a draft model (the target itself: every
    greedy draft kept) under the engine; on the CPU's numba path the draft's steps run
    as one compiled call."""
    from rvllm import LLM, SamplingParams
    from rvllm.spec_decode.draft import ModelDrafter

    eager = []
    forward = ModelDrafter._forward

    def counted(self, chunks, logits=True):
        eager.append(logits)
        return forward(self, chunks, logits)

    monkeypatch.setattr(ModelDrafter, "_forward", counted)
    # A draft model computes each prompt into its cache in passes of this many tokens.
    monkeypatch.setattr("rvllm.spec_decode.draft.CATCH_UP_TOKENS", 7)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = _repetitive_prompts()
    plain = LLM(str(model_dirs[arch]))
    expected = _generate(plain, prompts, params)
    del plain
    config = ({"method": "self_draft", "num_speculative_tokens": 3} if method == "self_draft"
              else {"method": "draft_model", "num_speculative_tokens": 3,
                    "model": str(model_dirs[arch])})
    spec = LLM(str(model_dirs[arch]), speculative_config=config)
    assert _generate(spec, prompts, params) == expected
    stats = spec.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens <= stats.num_draft_tokens
    per_pos = stats.accepted_per_pos
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    if method == "draft_model":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    bm = spec.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not any(eager), "the draft's greedy steps should run compiled"


def test_a_draft_model_of_another_family_on_the_torch_kernels(model_dirs):
    """A draft that is another model with the same vocabulary (Qwen2 drafting for Llama),
    on the torch kernels: the draft steps a forward pass at a time, and the output is
    still exactly greedy decoding's; sampled, seeded requests stay reproducible."""
    from rvllm import LLM, SamplingParams

    target = str(model_dirs["llama"])
    prompts = _repetitive_prompts()
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = LLM(target, kernel_backend="torch")
    expected = _generate(plain, prompts, greedy)
    del plain
    config = {"method": "draft_model", "num_speculative_tokens": 2,
              "model": str(model_dirs["qwen2"])}
    spec = LLM(target, kernel_backend="torch", speculative_config=config)
    assert _generate(spec, prompts, greedy) == expected
    assert spec.engine.spec_stats.num_drafts > 0
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)
    assert _generate(spec, prompts, sampled) == _generate(spec, prompts, sampled)


def test_model_proposers_refuse_what_cannot_work(llama_dir, tmp_path):
    from conftest import build_model

    from rvllm import LLM

    with pytest.raises(ValueError, match="num_draft_layers"):
        LLM(str(llama_dir), speculative_config={"method": "self_draft",
                                                "num_speculative_tokens": 2,
                                                "num_draft_layers": 2})
    other_vocab = build_model("llama", tmp_path / "other", vocab_size=640)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(llama_dir), speculative_config={"method": "draft_model",
                                                "num_speculative_tokens": 2,
                                                "model": str(other_vocab)})
    with pytest.raises(ValueError, match="one rank"):
        LLM(str(llama_dir), tensor_parallel_size=2,
            speculative_config={"method": "self_draft", "num_speculative_tokens": 2})


def test_server_takes_the_flag_and_reports_vllm_metrics(llama_dir):
    import json

    import httpx
    from server_helpers import ServerProcess, scrape

    server = ServerProcess(llama_dir, "--speculative-config", json.dumps(NGRAM))
    try:
        prompt = _repetitive_prompts()[1]
        r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40
        m = scrape(server.url)

        def value(name: str) -> float:
            return m[name]

        drafted = value("vllm:spec_decode_num_draft_tokens_total")
        accepted = value("vllm:spec_decode_num_accepted_tokens_total")
        assert 0 < accepted <= drafted and value("vllm:spec_decode_num_drafts_total") > 0
        per_pos = [m[k] for k in sorted(
            (k for k in m if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total")),
            key=lambda k: int(k.split("position=")[1].rstrip("}")))]
        assert len(per_pos) == NGRAM["num_speculative_tokens"] and sum(per_pos) == accepted
        assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    finally:
        server.stop()
    with pytest.raises(RuntimeError, match="exited"):
        ServerProcess(llama_dir, "--speculative-config", '{"method": "medusa", '
                      '"num_speculative_tokens": 2}', timeout=60)


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
def test_structured_output_under_speculation(llama_dir, backend):
    """Constrained requests speculate too: each draft position is masked as the grammar
    stands after the drafts before it, and the grammar is rolled back over the drafts the
    step did not keep. Greedy and seeded sampled output equal those without speculation
    and meet their constraints; the draft model (the target itself) has drafts kept."""
    from test_structured_output import PROMPTS, SPECS, constraint_holds

    from rvllm import LLM, SamplingParams

    kinds = ["json", "grammar"]
    params = [SamplingParams(temperature=t, seed=5, max_tokens=120,
                             structured_outputs=SPECS[kind])
              for kind in kinds for t in (0.0, 1.0)]

    def run(llm):
        return [[out.outputs[0].text for out in llm.generate(PROMPTS, p)] for p in params]

    so = {"backend": backend}
    plain = LLM(str(llama_dir), structured_outputs_config=so, max_model_len=256)
    expected = run(plain)
    del plain
    for config in (NGRAM, _proposers(llama_dir)["draft_model"]):
        spec = LLM(str(llama_dir), structured_outputs_config=so, max_model_len=256,
                   speculative_config=config)
        assert run(spec) == expected
        stats = spec.engine.spec_stats
        if config["method"] == "draft_model":
            assert stats.num_accepted_tokens > 0
        del spec
    for texts, kind in zip(expected, [k for k in kinds for _ in range(2)]):
        assert all(constraint_holds(kind, t) for t in texts)
