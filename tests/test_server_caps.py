"""Caps on the sizes of a request's lists and strings (each a 400 naming its field), error
messages that quote at most a slice of what the client sent, and CORS."""

from __future__ import annotations

import argparse
import json
import types

import httpx
import pytest
from fastapi.testclient import TestClient
from server_helpers import API_KEY, HEADERS, MODEL_NAME, ServerProcess

from rvllm.server import protocol
from rvllm.server.app import build_app
from rvllm.server.args import add_serve_args, cors_options
from rvllm.server.errors import MAX_MESSAGE_CHARS, MAX_QUOTED_CHARS, APIError, bound_message

C, CHAT, TOKENIZE = "/v1/completions", "/v1/chat/completions", "/tokenize"
MSG = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
MB = 2**20


@pytest.fixture(scope="module")
def server(llama_dir):
    srv = ServerProcess(llama_dir, "--served-model-name", MODEL_NAME, "--api-key", API_KEY,
                        "--num-gpu-blocks", "64")
    yield srv
    srv.stop()


# (name, path, body, param, text in the message)
OVER_CAPS = [
    ("n", C, {"prompt": "hi", "n": protocol.MAX_N + 1}, "n", "128"),
    ("chat n", CHAT, {"messages": [MSG], "n": protocol.MAX_N + 1}, "n", "128"),
    ("best_of", C, {"prompt": "hi", "best_of": protocol.MAX_BEST_OF + 1}, "best_of", "128"),
    ("best_of below n", C, {"prompt": "hi", "n": 3, "best_of": 2}, "best_of", "at least n"),
    ("logit_bias", C, {"prompt": "hi", "logit_bias": {
        str(i): 1.0 for i in range(protocol.MAX_LOGIT_BIAS + 1)}}, "logit_bias", "1024"),
    ("chat logit_bias", CHAT, {"messages": [MSG], "logit_bias": {
        str(i): 1.0 for i in range(protocol.MAX_LOGIT_BIAS + 1)}}, "logit_bias", "1024"),
    ("stop strings", C, {"prompt": "hi", "stop": ["x"] * (protocol.MAX_STOP_STRINGS + 1)},
     "stop", "64"),
    ("chat stop strings", CHAT,
     {"messages": [MSG], "stop": ["x"] * (protocol.MAX_STOP_STRINGS + 1)}, "stop", "64"),
    ("stop string too long", C,
     {"prompt": "hi", "stop": "x" * (protocol.MAX_STOP_STRING_CHARS + 1)}, "stop", "1024"),
    ("stop list string too long", CHAT,
     {"messages": [MSG], "stop": ["ab", "x" * (protocol.MAX_STOP_STRING_CHARS + 1)]},
     "stop", "1024"),
    ("messages", CHAT, {"messages": [MSG] * (protocol.MAX_MESSAGES + 1)}, "messages", "4096"),
    ("tokenize messages", TOKENIZE, {"messages": [MSG] * (protocol.MAX_MESSAGES + 1)},
     "messages", "4096"),
    ("tools", CHAT, {"messages": [MSG], "tools": [TOOL] * (protocol.MAX_TOOLS + 1)},
     "tools", "128"),
    ("prompts", C, {"prompt": ["hi"] * (protocol.MAX_PROMPTS + 1)}, "prompt", "1024"),
    ("token-id prompts", C, {"prompt": [[1, 2]] * (protocol.MAX_PROMPTS + 1)}, "prompt",
     "1024"),
    ("stop_token_ids", C,
     {"prompt": "hi", "stop_token_ids": [1] * (protocol.MAX_STOP_TOKEN_IDS + 1)},
     "stop_token_ids", "1024"),
    ("chat stop_token_ids", CHAT,
     {"messages": [MSG], "stop_token_ids": [1] * (protocol.MAX_STOP_TOKEN_IDS + 1)},
     "stop_token_ids", "1024"),
]


@pytest.mark.parametrize(("name", "path", "body", "param", "text"), OVER_CAPS,
                         ids=[c[0] for c in OVER_CAPS])
def test_over_a_cap_is_a_400_naming_the_field(server, name, path, body, param, text):
    r = httpx.post(server.url + path, json=body, headers=HEADERS, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert text in error["message"] and param in error["message"]


def test_at_the_caps_is_accepted(server):
    stops = ["x" * protocol.MAX_STOP_STRING_CHARS] * protocol.MAX_STOP_STRINGS
    body = {"prompt": "hi", "max_tokens": 2, "stop": stops,
            "stop_token_ids": [i % 300 for i in range(protocol.MAX_STOP_TOKEN_IDS)]}
    r = httpx.post(server.url + C, json=body, headers=HEADERS, timeout=60)
    assert r.status_code == 200, r.text
    body = {"messages": [MSG], "max_tokens": 2, "tools": [TOOL] * protocol.MAX_TOOLS,
            "tool_choice": "none"}
    r = httpx.post(server.url + CHAT, json=body, headers=HEADERS, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(server.url + TOKENIZE, json={"messages": [MSG] * protocol.MAX_MESSAGES},
                   timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("template", [
    "{% include '/etc/hostname' %}",
    "{% import '/etc/hostname' as h %}{{ h }}",
    "{{ ''.__class__.__mro__ }}",
])
def test_a_chat_template_in_a_request_reads_no_file(server, template):
    """A request's chat template is template text, rendered in a sandbox with no loader:
    it can neither include a file nor reach Python's internals (a 400), and a path given
    as the template is only text."""
    body = {"messages": [MSG], "chat_template": template, "max_tokens": 1}
    r = httpx.post(server.url + CHAT, json=body, headers=HEADERS, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages"
    body = {"messages": [MSG], "chat_template": "/etc/hostname", "max_tokens": 1}
    r = httpx.post(server.url + CHAT, json=body, headers=HEADERS, timeout=60)
    assert r.status_code == 200, r.text
    as_text = httpx.post(server.url + TOKENIZE, json={"prompt": "/etc/hostname",
                                                      "add_special_tokens": False},
                         headers=HEADERS, timeout=60).json()["count"]
    assert r.json()["usage"]["prompt_tokens"] == as_text


def test_caps_at_the_model_boundary():
    # Exactly at each cap validates; one past it does not (the same check as above, with
    # no server: cheap enough for the largest lists).
    # (The tiny model's vocabulary is smaller than 1,024 token ids, so logit_bias's cap is
    # met here and not through the server.)
    ok = {"prompt": ["a"] * protocol.MAX_PROMPTS, "n": protocol.MAX_N,
          "best_of": protocol.MAX_BEST_OF,
          "logit_bias": {str(i): 1.0 for i in range(protocol.MAX_LOGIT_BIAS)}}
    protocol.CompletionRequest.model_validate_json(json.dumps(ok))
    protocol.CompletionRequest.model_validate_json(
        json.dumps({"prompt": list(range(5000))}))  # one prompt's ids: not capped here
    protocol.ChatCompletionRequest.model_validate_json(
        json.dumps({"messages": [MSG] * protocol.MAX_MESSAGES}))


# ------------------------------------------------------- messages quote only a slice


def assert_bounded(r: httpx.Response) -> dict:
    error = r.json()["error"]
    assert len(error["message"]) < 1024, len(error["message"])
    assert len(r.content) < 2048, len(r.content)  # param too
    return error


def test_megabyte_unknown_field_is_quoted_clipped(server):
    name = "q" * MB
    for path, body in [(C, {"prompt": "hi", name: 1}), (CHAT, {"messages": [MSG], name: 1}),
                       (TOKENIZE, {"prompt": "hi", name: 1}),
                       (C, {"prompt": "hi", "structured_outputs": {name: 1}}),
                       (C, {"prompt": "hi", "logit_bias": {name: "x"}})]:
        r = httpx.post(server.url + path, json=body, headers=HEADERS, timeout=60)
        assert r.status_code == 400
        error = assert_bounded(r)
        assert "q\u2026" in error["message"] and "q\u2026" in error["param"]
        assert "q" * (MAX_QUOTED_CHARS + 1) not in r.text
    assert error["message"].startswith("Invalid value for 'logit_bias.qqq")


def test_megabyte_model_name_is_quoted_clipped(server):
    for path, body in [(C, {"prompt": "hi"}), (CHAT, {"messages": [MSG]}),
                       (TOKENIZE, {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})]:
        for model in ["m" * MB, "m " * (MB // 2)]:  # one word, or many
            r = httpx.post(server.url + path, json={**body, "model": model}, headers=HEADERS,
                           timeout=60)
            assert r.status_code == 404
            error = assert_bounded(r)
            assert error["message"].startswith("The model `m")
            assert error["message"].endswith("\u2026` does not exist.")


def test_other_quoted_values_are_clipped(server):
    named = {"type": "function", "function": {"name": "n" * MB}}
    r = httpx.post(server.url + CHAT, json={"messages": [MSG], "tools": [TOOL],
                                            "tool_choice": named}, headers=HEADERS,
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert_bounded(r)
    part = {"type": "t" * MB, "text": "x"}
    r = httpx.post(server.url + CHAT, json={"messages": [{"role": "user", "content": [part]}]},
                   headers=HEADERS, timeout=60)
    assert r.status_code == 400
    assert_bounded(r)


@pytest.mark.parametrize("message", [
    "The model `" + "a" * MB + "` does not exist.",
    "The model `" + "a " * MB + "` does not exist.",
    "tool_choice names the function " + repr("x" * MB) + ", which is not in tools.",
    "stop must be a list of non-empty strings, got " + repr(["s" * 1024] * 64) + ".",
    "x" * MB,
    "word " * MB,
])
def test_every_message_is_bounded(message):
    bounded = APIError(message, param="p" * MB)
    assert len(bounded.message) <= MAX_MESSAGE_CHARS + 8
    assert len(bounded.param or "") <= MAX_QUOTED_CHARS + 1
    assert str(bounded) == bounded.message
    # A clipped value keeps its quotes and the punctuation after it.
    assert all(len(word) <= MAX_QUOTED_CHARS + 5 for word in bounded.message.split())


def test_the_servers_own_words_are_left_alone():
    for message in ["This model's maximum context length is 256 tokens, and the messages "
                    "(4000 characters) are longer than that; the user's request is refused.",
                    "tool_choice 'required' forces its own output format: it cannot be "
                    "combined with response_format, structured_outputs or guided_*."]:
        assert bound_message(message) == message


# -------------------------------------------------------------------------- CORS


def cors_app(*flags: str) -> TestClient:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    ns = parser.parse_args(list(flags))
    engine = types.SimpleNamespace(model_path="/models/tiny", max_model_len=256,
                                   is_running=True, step_observers=[], shutdown=lambda: None)
    app = build_app(engine, MODEL_NAME, API_KEY, cors=cors_options(ns))  # type: ignore[arg-type]
    return TestClient(app)


def preflight(client: TestClient, origin: str, method: str = "POST") -> httpx.Response:
    return client.options(CHAT, headers={
        "Origin": origin, "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_defaults_allow_any_origin():
    client = cors_app()
    r = preflight(client, "http://app.example")
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-credentials" not in r.headers
    # An error refused by the API key still carries the header a browser needs.
    r = client.post(CHAT, json={"messages": [MSG]}, headers={"Origin": "http://app.example"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"


def test_cors_flags_restrict_origins_methods_and_headers():
    client = cors_app("--allowed-origins", '["http://app.example"]',
                      "--allowed-methods", '["POST"]', "--allowed-headers", '["content-type"]',
                      "--allow-credentials")
    r = preflight(client, "http://app.example")
    assert r.status_code == 400  # authorization is not an allowed header
    r = client.options(CHAT, headers={"Origin": "http://app.example",
                                      "Access-Control-Request-Method": "POST",
                                      "Access-Control-Request-Headers": "content-type"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://app.example"
    assert r.headers["access-control-allow-credentials"] == "true"
    assert preflight(client, "http://evil.example").status_code == 400
    r = client.options(CHAT, headers={"Origin": "http://app.example",
                                      "Access-Control-Request-Method": "DELETE",
                                      "Access-Control-Request-Headers": "content-type"})
    assert r.status_code == 400


def test_cors_flags_parse_json_lists():
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    ns = parser.parse_args([])
    assert cors_options(ns) == {"allowed_origins": ["*"], "allowed_methods": ["*"],
                                "allowed_headers": ["*"], "allow_credentials": False}
    for bad in ["http://a.example", '"*"', '[1]']:
        with pytest.raises(SystemExit):
            parser.parse_args(["--allowed-origins", bad])
    with pytest.raises(ValueError, match="allowed_origin"):
        build_app(types.SimpleNamespace(step_observers=[]), MODEL_NAME, None,  # type: ignore[arg-type]
                  cors={"allowed_origin": ["*"]})
