"""The sampling fields that shape a completion's text: ``include_stop_str_in_output`` and
``spaces_between_special_tokens``, whole and as streamed deltas, on the tiny Llama."""

from __future__ import annotations

from pathlib import Path

import pytest

from rvllm import LLM, SamplingParams

PROMPT = [5, 6, 7, 8, 9, 10, 11]
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), kernel_backend="torch")


@pytest.fixture(scope="module")
def free_text(llm: LLM) -> str:
    """The greedy continuation with no stop string: where the stop strings are cut from."""
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=40, **GREEDY))
    text = out[0].outputs[0].text
    assert len(text) > 20, text
    return text


def _stop_string(free_text: str) -> tuple[str, int]:
    """A stop string taken from the middle of the free text, and where it first starts."""
    stop = free_text[10:13]
    return stop, free_text.index(stop)


def _streamed(llm: LLM, params: SamplingParams) -> list[str]:
    """Each step's text of the one request, as a streaming caller sees it."""
    engine = llm.engine
    engine.add_request("streamed", {"prompt_token_ids": PROMPT}, params)
    texts = []
    while engine.has_unfinished_requests():
        texts += [out.outputs[0].text for out in engine.step()]
    return texts


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_ends_the_text_without_or_with_itself(llm: LLM, free_text: str,
                                                           include: bool) -> None:
    stop, at = _stop_string(free_text)
    params = SamplingParams(max_tokens=40, stop=[stop], include_stop_str_in_output=include,
                            **GREEDY)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free_text[:at + len(stop) if include else at]


@pytest.mark.parametrize("include", [False, True])
def test_streamed_text_never_shows_a_stop_string_it_will_cut(llm: LLM, free_text: str,
                                                            include: bool) -> None:
    """Text that could still be the start of a stop string is held back while streaming:
    without the stop string in the output, no step ever shows a piece of it; with it,
    the last step shows it whole. Every step's text extends the one before."""
    stop, at = _stop_string(free_text)
    params = SamplingParams(max_tokens=40, stop=[stop], include_stop_str_in_output=include,
                            **GREEDY)
    texts = _streamed(llm, params)
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == free_text[:at + len(stop) if include else at]
    if not include:
        assert all(len(t) <= at for t in texts)


@pytest.mark.parametrize("spaces", [True, False])
def test_special_tokens_in_the_output_decode_as_the_tokenizer_places_them(
        llm: LLM, spaces: bool) -> None:
    """With special tokens kept (``skip_special_tokens=False``), the text is the fast
    tokenizer's own decode whichever ``spaces_between_special_tokens`` says: the
    ``tokenizers`` backend places special tokens itself, as vLLM's fast detokenizer does
    (the field changes only slow, Python tokenizers there). Streamed and whole agree."""
    tokenizer = llm.get_tokenizer()
    special = tokenizer.encode("<|im_start|>", add_special_tokens=False)
    assert len(special) == 1
    params = SamplingParams(max_tokens=4, logit_bias={special[0]: 100.0},
                            skip_special_tokens=False, spaces_between_special_tokens=spaces,
                            **GREEDY)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0]
    assert out.token_ids == special * 4
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=False)
    assert out.text == "<|im_start|>" * 4
    assert _streamed(llm, params)[-1] == out.text


def test_special_tokens_are_dropped_from_the_text_by_default(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    special = tokenizer.encode("<|im_start|>", add_special_tokens=False)
    params = SamplingParams(max_tokens=3, logit_bias={special[0]: 100.0}, **GREEDY)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0]
    assert out.token_ids == special * 3 and out.text == ""
