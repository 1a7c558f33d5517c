"""Structured output in the engine: every constraint kind holds on every sample, on both
grammar engines, and a constraint changes nothing else: unconstrained rows in the same
batch, preemption, prefix hits, seeds, stop strings and lengths behave as without it."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

from rvllm import LLM, SamplingParams
from rvllm.engine.sequence import SequenceStatus
from rvllm.layers.sampler import apply_grammar_masks_
from rvllm.sampling_params import StructuredOutputsParams
from rvllm.structured_output.gate import GatedMatcher

BACKENDS = ["guidance", "xgrammar"]
PROMPTS = ["Paris is the capital", "def add(a, b):", "The quick brown fox", "Emoji: "]

# Bounded constraints: a random tiny model must still end inside max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["fox", "dog", "cat"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"type": "string", "pattern": "^[a-z]{1,4}$"},
        "inner": {"type": "object", "properties": {"x": {"enum": [1, 2]}},
                  "required": ["x"], "additionalProperties": False},
        "list": {"type": "array", "items": {"type": "boolean"}, "minItems": 1,
                 "maxItems": 2},
    },
    "required": ["kind", "ok", "n", "tag", "inner", "list"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,4}-[0-9]{2}"
CHOICES = ["alpha", "beta", "gamma delta"]
# Sums of small numbers: start, "+"-separated terms, at most three of them.
GRAMMAR = 'start: num ("+" num)? ("+" num)?\nnum: /[1-9]/'
GRAMMAR_TEXT = re.compile(r"[1-9](\+[1-9]){0,2}")


def constraint_holds(kind: str, text: str) -> bool:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    if kind == "grammar":
        return GRAMMAR_TEXT.fullmatch(text) is not None
    return isinstance(json.loads(text), dict)  # json_object


SPECS = {"json": dict(json=SCHEMA, disable_any_whitespace=True), "regex": dict(regex=REGEX),
         "choice": dict(choice=CHOICES), "grammar": dict(grammar=GRAMMAR)}


@pytest.fixture(scope="module", params=BACKENDS)
def llm(request, llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), structured_outputs_config={"backend": request.param},
               max_model_len=256)


@pytest.mark.parametrize("kind", list(SPECS))
def test_every_sample_meets_its_constraint(llm: LLM, kind: str) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=120, structured_outputs=SPECS[kind])
    sampled = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=120,
                             structured_outputs=SPECS[kind])
    for params in (greedy, sampled):
        for out in llm.generate(PROMPTS, params):
            for c in out.outputs:
                assert c.finish_reason == "stop", (c.text, c.finish_reason)
                assert constraint_holds(kind, c.text), c.text


def test_unconstrained_rows_are_unchanged_beside_constrained_ones(llm: LLM) -> None:
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain)]
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"plain-{i}", prompt, plain)
        engine.add_request(f"json-{i}", prompt, SamplingParams(
            temperature=0, max_tokens=120, structured_outputs=SPECS["json"]))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    assert [done[f"plain-{i}"].token_ids for i in range(len(PROMPTS))] == alone
    for i in range(len(PROMPTS)):
        assert constraint_holds("json", done[f"json-{i}"].text)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_chunking_keep_constrained_output(llama_dir: Path, mode: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=120, structured_outputs=SPECS["json"])
    prompts = [p * 3 for p in PROMPTS] * 2
    roomy = LLM(str(llama_dir), max_model_len=256)
    expected = [o.outputs[0].text for o in roomy.generate(prompts, params)]
    del roomy
    tight = LLM(str(llama_dir), max_model_len=192, num_gpu_blocks=26, block_size=8,
                max_num_batched_tokens=32, preemption_mode=mode,
                num_cpu_blocks=64 if mode == "swap" else 0)
    got = [o.outputs[0].text for o in tight.generate(prompts, params)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected
    # Again, now from the prefix cache.
    assert [o.outputs[0].text for o in tight.generate(prompts, params)] == expected


def test_seeds_logprobs_stop_strings_and_lengths(llm: LLM) -> None:
    so = SPECS["regex"]
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=20, logprobs=2,
                            structured_outputs=so)
    first, again = (llm.generate(PROMPTS[0], seeded)[0].outputs[0] for _ in range(2))
    assert first.text == again.text and first.token_ids == again.token_ids
    assert len(first.logprobs) == len(first.token_ids)
    assert all(t in entry for t, entry in zip(first.token_ids, first.logprobs))
    stopped = llm.generate(PROMPTS[0], SamplingParams(
        temperature=0, max_tokens=20, stop=["-"], structured_outputs=so))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "-"
    assert re.fullmatch(r"[a-c]{2,4}", stopped.text)
    cut = llm.generate(PROMPTS[0], SamplingParams(
        temperature=0, max_tokens=1, structured_outputs=dict(json=SCHEMA)))[0].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 1


def test_bad_constraints_are_refused_before_queueing(llm: LLM) -> None:
    engine = llm.engine
    bad = [dict(json={"type": "strange"}), dict(regex="([a-z"),
           dict(grammar="start: missing_rule")]
    for spec in bad:
        with pytest.raises(ValueError, match="structured_outputs"):
            engine.add_request(None, "hi", SamplingParams(structured_outputs=spec))
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs=dict(regex="a", choice=["a"]))
    with pytest.raises(ValueError, match="no field"):
        SamplingParams(structured_outputs=dict(yaml="a"))
    with pytest.raises(ValueError, match="backend"):
        LLM(structured_outputs_config={"backend": "outlines"})


def test_compiled_grammars_are_cached_and_counted(llm: LLM) -> None:
    manager = llm.engine.structured_outputs
    spec = StructuredOutputsParams(choice=["cached", "twice"])
    before = manager.num_requests
    first = manager.compile(spec)
    assert manager.compile(StructuredOutputsParams(choice=["cached", "twice"])) is first
    assert manager.num_requests == before + 2
    first.result(timeout=60)
    assert manager.compile_count >= 1 and sum(manager.compile_bucket_counts) == \
        manager.compile_count


def test_a_token_the_grammar_refuses_ends_with_error(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("refused", "hi", SamplingParams(
        temperature=0, max_tokens=10, structured_outputs=dict(choice=["ab"])))
    while not engine.scheduler.running and not engine.scheduler.waiting:
        engine.step()  # until its grammar has compiled and it is scheduled
    seq = engine.requests["refused"].seqs[0]
    allowed = torch.zeros((1, (engine.model_config.vocab_size + 31) // 32), dtype=torch.int32)
    seq.grammar.fill(allowed, 0)
    bits = np.unpackbits(allowed.numpy().view(np.uint8), bitorder="little")
    refused = int(np.flatnonzero(bits == 0)[0])
    assert engine._advance_grammar(seq, refused) is SequenceStatus.FINISHED_ERROR
    assert SequenceStatus.FINISHED_ERROR.finish_reason == "error"
    engine.abort_request("refused")


def test_mask_widening_on_a_device_matches_the_host_path() -> None:
    class Fixed:
        def __init__(self, words: list[int]) -> None:
            self.words = words

        def fill(self, bitmask: torch.Tensor, row: int) -> None:
            bitmask[row] = torch.tensor(self.words, dtype=torch.int32)

    vocab = 70
    rows = [Fixed([1 - 2**31, 0, 0b101]), Fixed([-1, -1, 0])]
    host = torch.zeros(3, vocab)
    apply_grammar_masks_(host, [0, 2], rows)
    allowed = [torch.isfinite(host[r]).nonzero().flatten().tolist() for r in (0, 2)]
    assert allowed == [[0, 31, 64, 66], list(range(64))]
    assert torch.isfinite(host[1]).all()


    import rvllm.layers.sampler as sampler

    dev = torch.zeros(3, vocab)
    original = sampler._widen_on_host
    try:
        sampler._widen_on_host = lambda logits: False
        apply_grammar_masks_(dev, [0, 2], rows)
    finally:
        sampler._widen_on_host = original
    assert torch.equal(torch.isfinite(dev), torch.isfinite(host))


def test_a_compiling_grammar_holds_back_only_its_own_request(llm: LLM, monkeypatch) -> None:
    engine = llm.engine
    manager = engine.structured_outputs
    release = threading.Event()
    compile_now = manager._compile

    def slow_compile(spec):
        assert release.wait(60), "the test never released the compile"
        return compile_now(spec)

    monkeypatch.setattr(manager, "_compile", slow_compile)
    engine.add_request("held", PROMPTS[0], SamplingParams(
        temperature=0, max_tokens=8, structured_outputs=dict(choice=["never", "seen"])))
    engine.add_request("free", PROMPTS[1], SamplingParams(temperature=0, max_tokens=4))
    finished = set()
    while "free" not in finished:
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert "held" not in finished and engine.requests["held"].seqs[0].num_output_tokens == 0
    release.set()
    while engine.has_unfinished_requests():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert "held" in finished


def test_a_constraint_after_a_marker_leaves_the_output_free_up_to_it(llm: LLM) -> None:
    """``starts_after`` (a reasoning model's ``</think>``): the output is the unconstrained
    one up to and including the marker, and meets the constraint after it."""
    free = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8,
                                                     ignore_eos=True))[0].outputs[0].token_ids
    k = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    params = SamplingParams(temperature=0, max_tokens=120, structured_outputs=dict(
        choice=CHOICES, starts_after=[free[k - 1], free[k]]))
    out = llm.generate([PROMPTS[0]], params)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[:k + 1] == free[:k + 1]
    rest = llm.engine.tokenizer.decode(out.token_ids[k + 1:], skip_special_tokens=True)
    assert rest in CHOICES, rest


def test_a_gated_grammar_takes_tokens_back_across_its_marker() -> None:
    class Recorder:
        def __init__(self) -> None:
            self.taken: list[int] = []

        def fill(self, bitmask: torch.Tensor, row: int) -> None:
            bitmask[row] = 0

        def accept(self, token_id: int) -> bool:
            self.taken.append(token_id)
            return token_id != 99

        def is_terminated(self) -> bool:
            return self.taken[-1:] == [7]

        def rollback(self, num_tokens: int) -> None:
            del self.taken[len(self.taken) - num_tokens:]

        def error(self) -> str:
            return "refused"

    inner = Recorder()
    gate = GatedMatcher(inner, [5, 6])
    mask = torch.zeros((1, 2), dtype=torch.int32)
    for token in (1, 5, 2, 5):
        assert gate.accept(token) and not gate.started
    gate.fill(mask, 0)
    assert (mask == -1).all()  # free: every token allowed
    assert gate.accept(6) and gate.started and inner.taken == []
    assert gate.accept(3) and gate.accept(7) and gate.is_terminated()
    assert inner.taken == [3, 7]
    gate.rollback(3)  # 6, 3 and 7: back before the marker's end
    assert not gate.started and inner.taken == [] and not gate.is_terminated()
    assert gate.accept(6) and gate.started
    gate.fill(mask, 0)
    assert (mask == 0).all()  # the grammar's mask now
    assert not gate.accept(99) and gate.error() == "refused"
    with pytest.raises(ValueError, match="starts_after"):
        StructuredOutputsParams(choice=["a"], starts_after=[])
