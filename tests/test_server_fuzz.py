"""A bounded property-based run against a real server: request bodies drawn by
hypothesis from every field both endpoints know, with values of the right type, the
wrong type, or out of range. No answer is a 5xx, the engine stays healthy, and the KV
cache's free blocks come back to their starting count."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import ServerProcess, scrape, wait_for

WATCHDOG_S = 120.0

_ANY = st.one_of(st.none(), st.booleans(), st.integers(-5, 300), st.floats(-3, 3),
                 st.text(max_size=12), st.lists(st.integers(-2, 600), max_size=4))
_TEXT = st.text(max_size=40)
_SCHEMA = st.sampled_from([{"type": "object"}, {"type": "string", "maxLength": 3},
                           {"enum": ["a", "b"]}, {"type": "nonsense"}, {}])
_SAMPLING = {
    "max_tokens": st.one_of(st.integers(-2, 12), _ANY),
    "temperature": st.one_of(st.floats(-1, 3), _ANY),
    "top_p": st.one_of(st.floats(-0.5, 1.5), _ANY),
    "top_k": st.one_of(st.integers(-3, 50), _ANY),
    "min_p": st.floats(-0.5, 1.5),
    "n": st.one_of(st.integers(-1, 4), _ANY),
    "seed": st.one_of(st.integers(-5, 2**40), _ANY),
    "stop": st.one_of(_TEXT, st.lists(_TEXT, max_size=3), _ANY),
    "stop_token_ids": st.one_of(st.lists(st.integers(-3, 10**6), max_size=3), _ANY),
    "presence_penalty": st.one_of(st.floats(-3, 3), _ANY),
    "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 3),
    "logit_bias": st.one_of(st.dictionaries(st.sampled_from(["1", "7", "-1", "x", "99999"]),
                                            st.floats(-150, 150), max_size=3), _ANY),
    "min_tokens": st.one_of(st.integers(-1, 20), _ANY),
    "ignore_eos": _ANY,
    "stream": st.booleans(),
    "logprobs": _ANY,
    "prompt_logprobs": st.one_of(st.integers(-1, 25), _ANY),
    "guided_choice": st.one_of(st.lists(_TEXT, max_size=3), _ANY),
    "guided_regex": st.sampled_from(["[a-c]{1,3}", "(", "x+", ""]),
    "structured_outputs": st.one_of(st.fixed_dictionaries({}, optional={
        "json": _SCHEMA, "regex": st.sampled_from(["ab", "(("]),
        "choice": st.lists(_TEXT, max_size=2), "grammar": st.sampled_from(["start: \"a\"",
                                                                           "start: b"])}), _ANY),
    "response_format": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(
        ["text", "json_object", "json_schema", "xml"])}, optional={
        "json_schema": st.fixed_dictionaries({"name": _TEXT}, optional={"schema": _SCHEMA})}),
        _ANY),
    "made_up_field": _ANY,
}
_COMPLETION = st.fixed_dictionaries(
    {"prompt": st.one_of(_TEXT, st.lists(_TEXT, min_size=1, max_size=3),
                         st.lists(st.integers(-2, 600), max_size=6), _ANY)},
    optional={**_SAMPLING, "echo": _ANY, "suffix": _ANY})
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "wizard"])},
    optional={"content": st.one_of(_TEXT, _ANY), "tool_call_id": _TEXT})
_TOOL = st.fixed_dictionaries({"type": st.sampled_from(["function", "other"]),
                               "function": st.fixed_dictionaries(
                                   {"name": st.sampled_from(["f", "g", ""])},
                                   optional={"parameters": _SCHEMA})})
_CHAT = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(_MESSAGE, max_size=3), _ANY)},
    optional={**_SAMPLING, "max_completion_tokens": _ANY, "top_logprobs": _ANY,
              "tools": st.one_of(st.lists(_TOOL, max_size=2), _ANY),
              "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]),
                                       st.fixed_dictionaries({"type": st.just("function"),
                                                              "function": st.fixed_dictionaries(
                                                                  {"name": st.just("f")})}),
                                       _ANY),
              "parallel_tool_calls": _ANY, "add_generation_prompt": _ANY})


@pytest.fixture(scope="module")
def server(llama_dir):
    srv = ServerProcess(llama_dir, "--num-gpu-blocks", "64", "--max-model-len", "256")
    yield srv
    srv.stop()


def _check(server, path: str, body: dict) -> None:
    r = httpx.post(server.url + path, json=body, timeout=WATCHDOG_S)
    assert r.status_code < 500, (body, r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


_FUZZ = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture,
                                        HealthCheck.too_slow])


@_FUZZ
@given(body=_COMPLETION)
def test_fuzzed_completions_never_fail_the_server(server, body):
    _check(server, "/v1/completions", body)


@_FUZZ
@given(body=_CHAT)
def test_fuzzed_chat_never_fails_the_server(server, body):
    _check(server, "/v1/chat/completions", body)


def test_after_the_fuzzing_the_engine_is_healthy_and_the_cache_free(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert wait_for(lambda: (m := scrape(server.url))["vllm:num_free_blocks"]
                    == m["vllm:num_gpu_blocks"], WATCHDOG_S)
    r = httpx.post(f"{server.url}/v1/completions", timeout=WATCHDOG_S,
                   json={"prompt": "still fine", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
