"""Beam search (``LLM.beam_search``, the API's ``use_beam_search``): the beams equal
transformers' ``num_beams`` search token for token in float32, best first; beams that
end with EOS are set aside and ranked by the length-penalized score; the server answers
through the openai client with the same beams."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from server_helpers import ServerProcess

from rvllm import LLM
from rvllm.beam_search import BeamSearch, BeamSearchParams, BeamSearchSequence, beam_score
from rvllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[1, 5, 9, 33, 7], list(range(3, 30)), [4, 8]]
NEW = 8


def hf_beams(model_dir, prompt: list[int], width: int) -> tuple[list[list[int]], list[float]]:
    """transformers' beams (EOS never ends one) and their cumulative logprobs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                         max_new_tokens=NEW, do_sample=False, early_stopping=False,
                         pad_token_id=0, length_penalty=1.0, output_scores=True,
                         return_dict_in_generate=True)
    beams = [s[len(prompt):].tolist() for s in out.sequences]
    # Its score is the sum over the generated length: undo that to compare sums.
    scores = (out.sequences_scores * NEW).tolist() if width > 1 else [None]
    return beams, scores


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir))


@pytest.mark.parametrize("width", [1, 3, 4])
def test_beams_equal_transformers_num_beams(llm, llama_dir, width):
    results = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                              BeamSearchParams(beam_width=width, max_tokens=NEW,
                                               ignore_eos=True))
    for prompt, result in zip(PROMPTS, results):
        beams, scores = hf_beams(llama_dir, prompt, width)
        assert [s.tokens[len(prompt):] for s in result.sequences] == beams
        assert all(s.tokens[:len(prompt)] == prompt for s in result.sequences)
        if width > 1:
            got = [s.cum_logprob for s in result.sequences]
            assert max(abs(a - b) for a, b in zip(got, scores)) < 1e-3
        assert all(s.finish_reason == "length" for s in result.sequences)
        text = llm.get_tokenizer().decode(result.sequences[0].tokens[len(prompt):])
        assert result.sequences[0].text == text


def test_a_text_prompt_and_a_prompt_past_the_context(llm):
    [result] = llm.beam_search("The quick brown fox", BeamSearchParams(2, 4))
    assert len(result.sequences) == 2
    assert result.sequences[0].tokens[:-4] == llm.get_tokenizer().encode("The quick brown fox")
    with pytest.raises(ValueError, match="maximum context length is 256"):
        llm.beam_search([[5] * 250], BeamSearchParams(2, 10))
    with pytest.raises(ValueError, match="beam_width must be at least 1"):
        BeamSearchParams(0, 4)


def _step(search: BeamSearch, tables: list[dict[int, float]]) -> None:
    """One step of ``search`` whose beams' next-token logprobs are ``tables``."""
    outputs = []
    for table in tables:
        ranked = sorted(table, key=table.get, reverse=True)
        entry = {t: Logprob(table[t], rank) for rank, t in enumerate(ranked, 1)}
        completion = CompletionOutput(0, "", [ranked[0]], None, [entry], "length")
        outputs.append(RequestOutput("r", None, [], None, [completion], True,
                                     RequestMetrics(0.0)))
    search.advance(outputs)


def test_beams_that_end_with_eos_are_set_aside_and_ranked_by_length():
    eos = 2
    search = BeamSearch([7, 7], BeamSearchParams(beam_width=2, max_tokens=3,
                                                 length_penalty=1.0), frozenset({eos}), 64)
    # Step 1: EOS is the best candidate: it finishes; token 5 and 6 live on.
    _step(search, [{eos: -0.1, 5: -0.5, 6: -0.7, 9: -3.0}])
    assert [s.tokens for s in search.finished] == [[7, 7, eos]]
    assert [s.tokens for s in search.beams] == [[7, 7, 5]]
    # Only one live beam is left (the other slot went to the finished one).
    _step(search, [{4: -0.2, 3: -0.4, eos: -5.0, 8: -6.0}])
    assert [s.tokens for s in search.beams] == [[7, 7, 5, 4], [7, 7, 5, 3]]
    _step(search, [{1: -0.1, 0: -2.0, eos: -3.0, 8: -4.0},
                   {1: -0.1, 0: -2.0, eos: -3.0, 8: -4.0}])
    assert search.done
    results = search.results(None)
    # Scores: the finished beam -0.1 / 2 (its EOS not counted), the live ones
    # -0.8 / 5 and -1.0 / 5.
    assert [s.tokens for s in results] == [[7, 7, eos], [7, 7, 5, 4, 1]]
    assert [s.finish_reason for s in results] == ["stop", "length"]
    assert results[0].stop_reason == eos
    assert beam_score(results[1], frozenset({eos}), 1.0) == pytest.approx(-0.8 / 5)
    # A steeper length penalty favours the longer beams.
    longer = BeamSearchSequence([7, 7, 5, 4, 1], cum_logprob=-0.8)
    assert beam_score(longer, frozenset(), 3.0) > beam_score(results[0], frozenset({eos}), 3.0)


@pytest.fixture(scope="module")
def server(llama_dir):
    srv = ServerProcess(llama_dir, "--served-model-name", "beams")
    yield srv
    srv.stop()


def test_use_beam_search_over_http_gives_the_same_beams(server, llm):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    prompt = "The quick brown fox"
    [want] = llm.beam_search(prompt, BeamSearchParams(3, 6))
    got = client.completions.create(model="beams", prompt=prompt, n=3, max_tokens=6,
                                    extra_body={"use_beam_search": True})
    assert [c.text for c in got.choices] == [s.text for s in want.sequences]
    assert [c.index for c in got.choices] == [0, 1, 2]
    prompt_len = len(llm.get_tokenizer().encode(prompt))
    assert got.usage.prompt_tokens == prompt_len
    assert got.usage.completion_tokens == sum(len(s.tokens) - prompt_len
                                              for s in want.sequences)
    messages = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model="beams", messages=messages, n=2, max_tokens=5,
                                          extra_body={"use_beam_search": True})
    ids = llm.get_tokenizer().encode(llm.get_tokenizer().apply_chat_template(
        messages, add_generation_prompt=True), add_special_tokens=False)
    [want] = llm.beam_search([ids], BeamSearchParams(2, 5))
    assert [c.message.content for c in chat.choices] == [s.text for s in want.sequences]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "use_beam_search": True, "n": 2, "stream": True}, "stream"),
    ({"prompt": "hi", "use_beam_search": True, "n": 2, "top_p": 0.5}, "top_p"),
    ({"prompt": "hi", "use_beam_search": True, "n": 2, "logprobs": 2}, "logprobs"),
    ({"prompt": "hi", "use_beam_search": True, "n": 2, "max_tokens": 1000}, None),
])
def test_what_beam_search_does_not_take_is_a_400(server, body, param):
    r = httpx.post(f"{server.url}/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
