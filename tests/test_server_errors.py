"""Bad input gets an OpenAI-style 4xx error, never a 500, and leaves the server healthy."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_helpers import API_KEY, HEADERS, MODEL_NAME, ServerProcess, scrape, wait_for


@pytest.fixture(scope="module")
def server(llama_dir):
    srv = ServerProcess(llama_dir, "--served-model-name", MODEL_NAME, "--api-key", API_KEY,
                        "--num-gpu-blocks", "64")
    yield srv
    srv.stop()


C, CHAT = "/v1/completions", "/v1/chat/completions"
OK_CHAT = [{"role": "user", "content": "hi"}]
LONG = "hello world " * 200  # far past the tiny model's 256-token context

# (name, path, body (dict, or raw bytes), status, param the error should name, text in it)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}]

BAD_REQUESTS = [
    ("malformed json", C, b'{"prompt": "a",', 400, None, "JSON"),
    ("body not an object", C, b'["a"]', 400, None, "object"),
    ("missing prompt", C, {"max_tokens": 2}, 400, "prompt", "prompt"),
    ("prompt wrong type", C, {"prompt": 5}, 400, "prompt", "prompt"),
    ("prompt mixed list", C, {"prompt": [1, "a"]}, 400, "prompt", "prompt"),
    ("prompt empty list", C, {"prompt": []}, 400, "prompt", "empty"),
    ("prompt empty string", C, {"prompt": ""}, 400, "prompt", "empty"),
    ("token id past vocab", C, {"prompt": [1, 10**6]}, 400, "prompt", "1000000"),
    ("negative token id", C, {"prompt": [-1]}, 400, "prompt", "-1"),
    ("prompt longer than context", C, {"prompt": LONG}, 400, None, "256"),
    ("max_tokens past context", C, {"prompt": "hi", "max_tokens": 1000}, 400, None, "1000"),
    ("max_tokens negative", C, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens", "0"),
    ("max_tokens fractional", C, {"prompt": "hi", "max_tokens": 1.5}, 400, "max_tokens", ""),
    ("temperature a string", C, {"prompt": "hi", "temperature": "hot"}, 400, "temperature", ""),
    ("temperature negative", C, {"prompt": "hi", "temperature": -1}, 400, "temperature", ""),
    ("top_p zero", C, {"prompt": "hi", "top_p": 0}, 400, "top_p", ""),
    ("top_p above one", C, {"prompt": "hi", "top_p": 1.5}, 400, "top_p", ""),
    ("top_k below -1", C, {"prompt": "hi", "top_k": -5}, 400, "top_k", ""),
    ("n zero", C, {"prompt": "hi", "n": 0}, 400, "n", ""),
    ("presence_penalty out of range", C, {"prompt": "hi", "presence_penalty": 3},
     400, "presence_penalty", ""),
    ("frequency_penalty out of range", C, {"prompt": "hi", "frequency_penalty": -3},
     400, "frequency_penalty", ""),
    ("repetition_penalty zero", C, {"prompt": "hi", "repetition_penalty": 0},
     400, "repetition_penalty", ""),
    ("min_p above one", C, {"prompt": "hi", "min_p": 2}, 400, "min_p", ""),
    ("logprobs too many", C, {"prompt": "hi", "logprobs": 21}, 400, "logprobs", "20"),
    ("prompt_logprobs too many", C, {"prompt": "hi", "prompt_logprobs": 21},
     400, "prompt_logprobs", "20"),
    ("logit_bias key not an id", C, {"prompt": "hi", "logit_bias": {"abc": 1}},
     400, "logit_bias", ""),
    ("logit_bias value out of range", C, {"prompt": "hi", "logit_bias": {"5": 200}},
     400, "logit_bias", ""),
    ("logit_bias id past vocab", C, {"prompt": "hi", "logit_bias": {"99999": 1}},
     400, None, "99999"),
    ("stop a number", C, {"prompt": "hi", "stop": 5}, 400, "stop", ""),
    ("stop_token_ids past vocab", C, {"prompt": "hi", "stop_token_ids": [99999]},
     400, None, "99999"),
    ("min_tokens above max_tokens", C, {"prompt": "hi", "max_tokens": 2, "min_tokens": 5},
     400, "min_tokens", ""),
    ("seed a string", C, {"prompt": "hi", "seed": "x"}, 400, "seed", ""),
    ("stream not a bool", C, {"prompt": "hi", "stream": "yes"}, 400, "stream", ""),
    ("stream_options without stream", C,
     {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, None, "stream"),
    ("suffix unsupported", C, {"prompt": "hi", "suffix": "x"}, 400, "suffix", "suffix"),
    ("unknown field", C, {"prompt": "hi", "temprature": 0.5}, 400, "temprature",
     "temprature"),
    ("unknown model", C, {"prompt": "hi", "model": "gpt-4"}, 404, "model", "gpt-4"),
    ("chat missing messages", CHAT, {"max_tokens": 2}, 400, "messages", "messages"),
    ("chat empty messages", CHAT, {"messages": []}, 400, "messages", "empty"),
    ("chat unknown role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]},
     400, "messages.0.role", ""),
    ("chat content a number", CHAT, {"messages": [{"role": "user", "content": 5}]},
     400, "messages.0.content", ""),
    ("chat image part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     400, "messages", "image_url"),
    ("chat top_logprobs without logprobs", CHAT, {"messages": OK_CHAT, "top_logprobs": 2},
     400, "top_logprobs", "logprobs"),
    ("chat top_logprobs too many", CHAT,
     {"messages": OK_CHAT, "logprobs": True, "top_logprobs": 25}, 400, "top_logprobs", "20"),
    ("chat tool_choice without tools", CHAT, {"messages": OK_CHAT, "tool_choice": "required"},
     400, "tool_choice", "tools"),
    ("chat tools empty", CHAT, {"messages": OK_CHAT, "tools": []}, 400, "tools", "empty"),
    ("chat named tool not in tools", CHAT,
     {"messages": OK_CHAT, "tools": TOOLS,
      "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     400, "tool_choice", "nope"),
    ("chat tool_choice unknown", CHAT, {"messages": OK_CHAT, "tools": TOOLS,
                                        "tool_choice": "always"}, 400, "tool_choice", ""),
    ("chat auto tools without a parser", CHAT, {"messages": OK_CHAT, "tools": TOOLS},
     400, "tool_choice", "--tool-call-parser"),
    ("chat constraint with a named tool", CHAT,
     {"messages": OK_CHAT, "tools": TOOLS, "guided_regex": "a+",
      "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     400, "tool_choice", "guided"),
    ("chat json_schema without schema", CHAT,
     {"messages": OK_CHAT, "response_format": {"type": "json_schema",
                                               "json_schema": {"name": "x"}}},
     400, "response_format", "schema"),
    ("chat response_format unknown type", CHAT,
     {"messages": OK_CHAT, "response_format": {"type": "yaml"}}, 400, "response_format.type",
     ""),
    ("schema that does not compile", CHAT,
     {"messages": OK_CHAT, "response_format": {"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "strange"}}}}, 400, "response_format", "strange"),
    ("regex that does not compile", C, {"prompt": "hi", "guided_regex": "([a-z"},
     400, "guided_regex", "regex"),
    ("grammar that does not compile", C,
     {"prompt": "hi", "structured_outputs": {"grammar": "start: undefined_rule"}},
     400, "structured_outputs", "undefined_rule"),
    ("two constraint kinds", C, {"prompt": "hi", "structured_outputs": {
        "regex": "a", "choice": ["a", "b"]}}, 400, "structured_outputs", "exactly one"),
    ("two constraint fields", C, {"prompt": "hi", "guided_choice": ["a"],
                                  "response_format": {"type": "json_object"}},
     400, "guided_choice", "one constraint"),
    ("empty choice", C, {"prompt": "hi", "guided_choice": []}, 400, "guided_choice", ""),
    ("unknown structured_outputs key", C,
     {"prompt": "hi", "structured_outputs": {"yaml": "x"}}, 400, "structured_outputs.yaml",
     ""),
    ("chat continue without assistant", CHAT,
     {"messages": OK_CHAT, "continue_final_message": True}, 400, "continue_final_message", ""),
    ("chat max_completion_tokens negative", CHAT,
     {"messages": OK_CHAT, "max_completion_tokens": -2}, 400, "max_completion_tokens", ""),
    ("chat unknown model", CHAT, {"messages": OK_CHAT, "model": "nope"}, 404, "model", "nope"),
    ("tokenize neither prompt nor messages", "/tokenize", {}, 400, "prompt", ""),
    ("detokenize id past vocab", "/detokenize", {"tokens": [10**6]}, 400, "tokens", ""),
    ("embeddings from a generating model", "/v1/embeddings", {"input": "hi"}, 400, None,
     "--runner pooling"),
    ("embeddings without input", "/v1/embeddings", {}, 400, "input", "input"),
    ("score from a generating model", "/score", {"text_1": "a", "text_2": "b"}, 400, None,
     "--runner pooling"),
]


@pytest.mark.parametrize(("name", "path", "body", "status", "param", "text"), BAD_REQUESTS,
                         ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_gets_openai_error(server, name, path, body, status, param, text):
    if isinstance(body, bytes):
        r = httpx.post(server.url + path, content=body, headers=HEADERS)
    else:
        r = httpx.post(server.url + path, json=body, headers=HEADERS)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    assert text in error["message"]


def test_table_covers_at_least_25_cases():
    assert len(BAD_REQUESTS) >= 25


def test_context_error_states_both_numbers(server):
    r = httpx.post(server.url + C, json={"prompt": "hi", "max_tokens": 1000}, headers=HEADERS)
    message = r.json()["error"]["message"]
    assert "256" in message and "1000" in message
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_batch_with_one_bad_prompt_queues_nothing(server):
    r = httpx.post(server.url + C, json={"prompt": ["fine", LONG]}, headers=HEADERS)
    assert r.status_code == 400
    # The engine takes the good prompt and refuses the long one; the server withdraws the
    # good one, which the engine does a step or so after the 400 is out: look until
    # nothing is left (a hang watchdog, 60 s), not just once.
    def left() -> tuple[float, float]:
        m = scrape(server.url)
        return m["vllm:num_requests_running"], m["vllm:num_requests_waiting"]

    assert wait_for(lambda: left() == (0, 0), 60.0), left()


def test_missing_or_wrong_api_key_is_401(server):
    r = httpx.post(server.url + C, json={"prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong",
                      max_retries=0).models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200  # health needs no key


def test_openai_client_raises_typed_errors(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="hi", temperature=-1)
    assert e.value.body["param"] == "temperature"


def test_unknown_route_and_wrong_method_are_error_json(server):
    r = httpx.get(f"{server.url}/v1/nothing", headers=HEADERS)
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.get(server.url + C, headers=HEADERS)
    assert r.status_code == 405 and r.json()["error"]["message"]


def test_server_is_healthy_and_serves_after_bad_requests(server):
    for _, path, body, *_ in BAD_REQUESTS:  # all of them again, back to back
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        httpx.post(server.url + path, headers=HEADERS, **kwargs)
    assert httpx.get(f"{server.url}/health").status_code == 200
    r = httpx.post(server.url + C, json={"prompt": "hi", "max_tokens": 3}, headers=HEADERS)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
