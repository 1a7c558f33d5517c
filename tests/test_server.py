"""The OpenAI-compatible server, end to end: a real server process on the tiny random
llama, through the official openai client and raw HTTP."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from server_helpers import (
    API_KEY,
    HEADERS,
    MODEL_NAME,
    ServerProcess,
    scrape,
    sse_events,
    wait_for,
)

ALIAS = "an-alias"


@pytest.fixture(scope="module")
def server(llama_dir):
    srv = ServerProcess(llama_dir, "--served-model-name", MODEL_NAME, ALIAS,
                        "--api-key", API_KEY, "--num-gpu-blocks", "256")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def tokenize(server, prompt: str) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt})
    return r.json()["tokens"]


PROMPT = "The quick brown fox"
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a capital city."}]


def _mapped_files(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def test_the_engine_has_a_process_of_its_own_and_the_server_never_imports_torch(server):
    """``rvllm serve`` loads the model in a child process while the server's own process
    imports the web stack: the server process must stay free of torch (its import is most
    of the start-up), and the child holds the model."""
    children = open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read().split()
    engines = [int(c) for c in children if "libtorch" in _mapped_files(int(c))]
    assert len(engines) == 1
    assert "libtorch" not in _mapped_files(server.proc.pid)


def test_disable_frontend_multiprocessing_keeps_the_engine_in_the_server(llama_dir):
    srv = ServerProcess(llama_dir, "--disable-frontend-multiprocessing", "--num-gpu-blocks", "64")
    try:
        assert "libtorch" in _mapped_files(srv.proc.pid)
        r = httpx.post(f"{srv.url}/v1/completions",
                       json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 3
    finally:
        srv.stop()


def test_completion_returns_text_and_exact_usage(server, client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == MODEL_NAME
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage.prompt_tokens == len(tokenize(server, PROMPT))
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_streamed_completion_equals_whole_for_greedy(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=20, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_chat_streamed_equals_whole_and_starts_with_the_role(client):
    kwargs = dict(model=MODEL_NAME, messages=CHAT, max_completion_tokens=16, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 16 == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_prompt_is_the_rendered_template(server, client):
    r = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT})
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4,
                                          temperature=0)
    assert chat.usage.prompt_tokens == r.json()["count"]
    # The same ids sent as a completion prompt give the same greedy text.
    same = client.completions.create(model=MODEL_NAME, prompt=r.json()["tokens"], max_tokens=4,
                                     temperature=0)
    assert same.choices[0].text == chat.choices[0].message.content


def test_chat_accepts_content_parts_and_all_roles(client):
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "Call the tool."},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "type": "function",
            "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "user", "content": [{"type": "text", "text": "And?"},
                                     {"type": "text", "text": "Go on."}]},
    ]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_continue_final_message_extends_the_assistant_turn(server, client):
    messages = [*CHAT, {"role": "assistant", "content": "Paris is"}]
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=3, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    ids = httpx.post(f"{server.url}/tokenize", json={
        "messages": messages, "continue_final_message": True, "add_generation_prompt": False,
    }).json()["tokens"]
    assert r.usage.prompt_tokens == len(ids)
    same = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=3, temperature=0)
    assert r.choices[0].message.content == same.choices[0].text
    # echo: the reply opens with the assistant message it continues, whole and streamed.
    echoed = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=3, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False,
                    "echo": True})
    assert echoed.choices[0].message.content == "Paris is" + same.choices[0].text
    events = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=3, temperature=0, stream=True,
        extra_body={"continue_final_message": True, "add_generation_prompt": False,
                    "echo": True})
    streamed = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    assert streamed == echoed.choices[0].message.content
    # After a user message there is nothing to echo.
    plain = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=3,
                                           temperature=0, extra_body={"echo": True})
    assert plain.choices[0].message.content == client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=3, temperature=0).choices[0].message.content


def test_per_request_chat_template_and_its_variables(server, client):
    template = "{{ greeting }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "abc"}], max_tokens=2,
        extra_body={"chat_template": template, "chat_template_kwargs": {"greeting": "Hi"}})
    expected = httpx.post(f"{server.url}/tokenize",
                          json={"prompt": "Hi[abc]", "add_special_tokens": False}).json()
    assert r.usage.prompt_tokens == expected["count"]


def test_n2_gives_two_choices_and_counts_both(client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, n=2, max_tokens=8,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == r.choices[1].text  # greedy: both the same
    assert r.usage.completion_tokens == 16
    seeded = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, n=2, max_tokens=8,
                                            temperature=1.0, seed=7)
    again = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, n=2, max_tokens=8,
                                           temperature=1.0, seed=7)
    assert [c.message.content for c in seeded.choices] == [c.message.content
                                                           for c in again.choices]


def test_list_of_prompts_numbers_choices_prompt_major(client):
    prompts = ["Paris is", "Berlin is"]
    r = client.completions.create(model=MODEL_NAME, prompt=prompts, n=2, max_tokens=4,
                                  temperature=0)
    assert [c.index for c in sorted(r.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    for i, p in enumerate(prompts):
        solo = client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=4,
                                         temperature=0)
        assert r.choices[2 * i].text == solo.choices[0].text


def test_stop_string_cuts_the_text(client):
    base = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = text[6:9]
    assert len(stop) == 3
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24,
                                  temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].text == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
        stream=True, extra_body={"ignore_eos": True}))
    assert streamed == r.choices[0].text


def test_completion_logprobs_are_greedy_top_entries(client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6,
                                  temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 4  # keyed by text: byte tokens that decode alike collide
        assert chosen == pytest.approx(max(top.values()))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


def test_chat_logprobs_and_top_logprobs(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert len(item.top_logprobs) == 3
        values = [t.logprob for t in item.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert item.logprob == pytest.approx(values[0])
        assert item.bytes == list(item.token.encode())


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(server, client):
    ids = tokenize(server, PROMPT)
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True,
                                  logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in ids]
    assert all(k.startswith("token_id:") for top in lp.top_logprobs[1:] for k in top)
    by_text = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4,
                                             temperature=0, logprobs=True, top_logprobs=2)
    by_id = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4,
                                           temperature=0, logprobs=True, top_logprobs=2,
                                           extra_body={"return_tokens_as_token_ids": True})
    named = [item.token for item in by_id.choices[0].logprobs.content]
    assert all(t.startswith("token_id:") for t in named)
    decoded = httpx.post(f"{server.url}/detokenize", headers=HEADERS, json={
        "tokens": [int(t.removeprefix("token_id:")) for t in named]}).json()["prompt"]
    assert decoded == "".join(item.token for item in by_text.choices[0].logprobs.content)
    assert by_id.choices[0].logprobs.content[0].bytes == list(named[0].encode())


def test_responses_api_answers_as_chat_does_whole_and_streamed(client):
    """/v1/responses: instructions and input render as a chat; the answer is the chat
    completion's, whole and in the Responses API's stream events."""
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=6,
                                          temperature=0)
    whole = client.responses.create(model=MODEL_NAME, instructions=CHAT[0]["content"],
                                    input=CHAT[1]["content"], max_output_tokens=6,
                                    temperature=0)
    assert whole.output_text == chat.choices[0].message.content
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    cut = chat.choices[0].finish_reason == "length"
    assert whole.status == ("incomplete" if cut else "completed")
    if cut:
        assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output[0].role == "assistant" and whole.model == MODEL_NAME
    events = list(client.responses.create(model=MODEL_NAME, input=CHAT, max_output_tokens=6,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done",
                          "response.incomplete" if cut else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == whole.output_text
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL_NAME, input="hi", previous_response_id="resp_x")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL_NAME, input=[])
    assert e.value.body["param"] == "input"


def test_echo_logprobs_max_tokens_0_scores_the_prompt_like_transformers(server, client,
                                                                        llama_dir):
    from transformers import AutoModelForCausalLM

    ids = tokenize(server, PROMPT)
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True,
                                  logprobs=1, temperature=0)
    choice = r.choices[0]
    assert choice.text == PROMPT and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    expected = [logits[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    # Token-id prompts, as lm-evaluation-harness sends them, give the same numbers.
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=0, echo=True,
                                       logprobs=1)
    assert by_ids.choices[0].logprobs.token_logprobs == lp.token_logprobs


def test_echo_with_one_generated_token_appends_it(client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, echo=True,
                                  logprobs=2, temperature=0, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(PROMPT)
    assert len(lp.tokens) == r.usage.prompt_tokens + 1
    assert lp.token_logprobs[-1] == pytest.approx(max(lp.top_logprobs[-1].values()))


def test_vllm_extra_sampling_fields_are_honoured(server, client):
    ids = tokenize(server, "fox")
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, extra_body={
        "top_k": 1, "min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 5,
        "stop_token_ids": [ids[0]], "skip_special_tokens": True,
        "include_stop_str_in_output": False, "ignore_eos": True})
    greedy = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].text == greedy.choices[0].text  # top_k=1 is greedy
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2,
                                  extra_body={"prompt_logprobs": 1})
    assert len(r.choices[0].model_extra["prompt_logprobs"]) == r.usage.prompt_tokens


def test_logit_bias_forces_a_token(server, client):
    token = tokenize(server, "fox")[0]
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0,
                                  logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    ids = tokenize(server, r.choices[0].text)
    assert ids == [token] * len(ids)


def test_allowed_token_ids_and_truncate_prompt_tokens(server, client):
    allowed = tokenize(server, "fox") + tokenize(server, " dog")
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0,
                                  extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    assert set(tokenize(server, r.choices[0].text)) <= set(allowed)
    tail = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3,
                                     temperature=0, extra_body={"truncate_prompt_tokens": 2})
    assert tail.usage.prompt_tokens == 2
    alone = client.completions.create(model=MODEL_NAME, prompt=tokenize(server, PROMPT)[-2:],
                                      max_tokens=3, temperature=0)
    assert tail.choices[0].text == alone.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi " * 40}], max_tokens=2,
        extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT,
                                  extra_body={"allowed_token_ids": []})
    assert e.value.body["param"] == "allowed_token_ids"
    with pytest.raises(openai.BadRequestError) as e:  # this server schedules fcfs
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, extra_body={"priority": 1})
    assert e.value.body["param"] == "priority"


def test_prompt_tokens_details_max_logprobs_and_priorities(llama_dir, client):
    """--enable-prompt-tokens-details: usage counts the prefix cache's tokens, whole and
    streamed; --max-logprobs moves the cap on logprobs (20 by default); under
    --scheduling-policy priority a request may give its priority."""
    long_prompt = " ".join(["fox"] * 40)
    assert client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1
                                     ).usage.prompt_tokens_details is None
    srv = ServerProcess(llama_dir, "--enable-prompt-tokens-details", "--max-logprobs", "30",
                        "--scheduling-policy", "priority", "--return-tokens-as-token-ids")
    try:
        other = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
        model = other.models.list().data[0].id
        first = other.completions.create(model=model, prompt=long_prompt, max_tokens=1,
                                         extra_body={"priority": -3})
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        again = other.completions.create(model=model, prompt=long_prompt, max_tokens=1)
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert 16 <= cached < again.usage.prompt_tokens
        events = list(other.chat.completions.create(
            model=model, messages=[{"role": "user", "content": long_prompt}], max_tokens=1,
            stream=True, stream_options={"include_usage": True}))
        assert events[-1].usage.prompt_tokens_details.cached_tokens == 0
        top = other.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=1,
            logprobs=True, top_logprobs=25)
        assert len(top.choices[0].logprobs.content[0].top_logprobs) == 25
        # --return-tokens-as-token-ids: by id, unless the request says otherwise.
        assert top.choices[0].logprobs.content[0].token.startswith("token_id:")
        text = other.completions.create(model=model, prompt=PROMPT, max_tokens=2, logprobs=1,
                                        extra_body={"return_tokens_as_token_ids": False})
        assert not any(t.startswith("token_id:") for t in text.choices[0].logprobs.tokens)
        with pytest.raises(openai.BadRequestError) as e:
            other.completions.create(model=model, prompt=PROMPT, max_tokens=1, logprobs=31)
        assert e.value.body["param"] == "logprobs" and "30" in e.value.body["message"]
    finally:
        srv.stop()


def test_models_health_version_tokenize_detokenize(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME, ALIAS]
    # Either name is served; responses carry the first.
    r = client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=1)
    assert r.model == MODEL_NAME
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]
    ids = tokenize(server, PROMPT)
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()
    assert back["prompt"] == PROMPT


def test_raw_http_stream_is_sse_and_ends_with_done(server):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=HEADERS) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = list(r.iter_lines())
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
    events = list(sse_events(iter(lines)))
    assert all(e["object"] == "text_completion" for e in events)


def test_metrics_count_the_requests_sent(server, client):
    before = scrape(server.url)
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=7,
                                  temperature=0, extra_body={"ignore_eos": True})
    client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=3,
                                   temperature=0, extra_body={"ignore_eos": True})
    chat_prompt = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT}).json()["count"]
    after = before

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    def counted() -> bool:
        nonlocal after
        after = scrape(server.url)
        return delta("vllm:request_success_total{finished_reason=length}") == 2

    # The server counts a step's outputs just after it has handed them out, so the client
    # can have its answer before the count: wait for the count (a hang watchdog, 60 s).
    assert wait_for(counted, 60.0)
    assert delta("vllm:prompt_tokens_total") == r.usage.prompt_tokens + chat_prompt
    assert delta("vllm:generation_tokens_total") == 10
    assert delta("vllm:request_success_total{finished_reason=length}") == 2
    for hist in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds"):
        assert delta(f"{hist}_count") == 2
    assert delta("vllm:inter_token_latency_seconds_count") == 6 + 2
    assert delta("vllm:prefix_cache_queries_total") >= r.usage.prompt_tokens
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0.0
