"""/openapi.json describes the API: request bodies from the pydantic models that validate
them, responses (whole and streamed) that what the server sends validates against, and
OpenAI's error shape under each error status."""

from __future__ import annotations

import json
import types
from typing import Any

import httpx
import jsonschema
import pytest
from server_helpers import API_KEY, HEADERS, MODEL_NAME, ServerProcess, sse_events

from rvllm.server import openapi, protocol
from rvllm.server.app import build_app

HTTP_METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}
# route -> (method, request body's schema, 200's JSON schema, its stream's event schema,
# the error statuses it lists)
ROUTES = {
    "/v1/completions": ("post", "CompletionRequest", "CompletionResponse",
                        "CompletionStreamResponse", {400, 401, 404, 413, 503}),
    "/v1/chat/completions": ("post", "ChatCompletionRequest", "ChatCompletionResponse",
                             "ChatCompletionStreamResponse", {400, 401, 404, 413, 503}),
    "/tokenize": ("post", "TokenizeRequest", "TokenizeResponse", None, {400, 404, 413}),
    "/detokenize": ("post", "DetokenizeRequest", "DetokenizeResponse", None, {400, 404, 413}),
    "/v1/models": ("get", None, "ModelList", None, {401}),
}
REF = "#/components/schemas/"


def stub_app(api_key: str | None = None) -> Any:
    """The app without an engine: enough for its OpenAPI document."""
    engine = types.SimpleNamespace(model_path="/models/tiny", max_model_len=256,
                                   is_running=True, step_observers=[],
                                   shutdown=lambda: None)
    return build_app(engine, MODEL_NAME, api_key)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return stub_app(API_KEY).openapi()


def resolve(doc: dict[str, Any], ref: str) -> dict[str, Any]:
    assert ref.startswith("#/"), ref
    node: Any = doc
    for part in ref[2:].split("/"):
        assert isinstance(node, dict) and part in node, f"{ref} does not resolve"
        node = node[part]
    return node


def refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [r for v in node.values() for r in refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in refs(v)]
    return []


def validator(doc: dict[str, Any], name: str) -> jsonschema.Draft202012Validator:
    """A JSON Schema validator for the document's component ``name``."""
    return jsonschema.Draft202012Validator({"$ref": REF + name,
                                            "components": doc["components"]})


def example(doc: dict[str, Any], schema: dict[str, Any]) -> Any:
    """The smallest value ``schema`` accepts, from its required fields only: the first
    branch of a union that is not null, the first of an enum, one item of a list."""
    if "$ref" in schema:
        return example(doc, resolve(doc, schema["$ref"]))
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    for union in ("anyOf", "oneOf"):
        branches = [b for b in schema.get(union, []) if b.get("type") != "null"]
        if branches and "type" not in schema and "properties" not in schema:
            return example(doc, branches[0])
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        required = list(schema.get("required", []))
        for branch in schema.get("oneOf", [])[:1]:  # /tokenize: prompt or messages
            required += branch.get("required", [])
        return {name: example(doc, schema["properties"][name]) for name in required}
    if kind == "array":
        return [example(doc, schema.get("items", {}))] * max(1, schema.get("minItems", 1))
    return {"string": "hi", "integer": 1, "number": 1.0, "boolean": True}[kind]


# ---------------------------------------------------------------- the document alone


def test_document_is_openapi_3_with_every_route(doc):
    assert doc["openapi"].startswith("3.")
    assert doc["info"]["title"] and doc["info"]["version"]
    for path, (method, *_) in ROUTES.items():
        assert method in doc["paths"][path], path
    for path, item in doc["paths"].items():
        assert path.startswith("/")
        assert set(item) <= HTTP_METHODS, path
        for operation in item.values():
            assert operation["responses"], path
            for status, response in operation["responses"].items():
                assert status == "default" or (status.isdigit() and len(status) == 3)
                assert response["description"], (path, status)


def test_every_ref_resolves_and_every_schema_is_json_schema(doc):
    found = refs(doc)
    assert len(found) > 50
    for ref in found:
        resolve(doc, ref)
    for schema in doc["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)


@pytest.mark.parametrize("path", ROUTES)
def test_route_documents_its_body_responses_and_errors(doc, path):
    method, body, ok, stream, errors = ROUTES[path]
    operation = doc["paths"][path][method]
    if body is None:
        assert "requestBody" not in operation
    else:
        request = operation["requestBody"]
        assert request["required"] is True
        assert request["content"]["application/json"]["schema"] == {"$ref": REF + body}
    content = operation["responses"]["200"]["content"]
    assert content["application/json"]["schema"] == {"$ref": REF + ok}
    if stream is not None:
        assert content["text/event-stream"]["schema"] == {"$ref": REF + stream}
        assert "[DONE]" in operation["responses"]["200"]["description"]
    listed = {int(s) for s in operation["responses"] if s != "200"}
    assert listed == errors
    for status in errors:
        schema = operation["responses"][str(status)]["content"]["application/json"]["schema"]
        assert schema == {"$ref": REF + "ErrorResponse"}
    assert ("security" in operation) == path.startswith("/v1")


def test_request_schemas_are_the_validating_models(doc):
    schemas = doc["components"]["schemas"]
    for model in openapi.REQUEST_MODELS:
        own = model.model_json_schema(ref_template=REF + "{model}")
        own.pop("$defs", None)
        assert schemas[model.__name__] == own
    # Strict like the models: unknown fields are refused.
    assert schemas["CompletionRequest"]["additionalProperties"] is False
    assert schemas["CompletionRequest"]["required"] == ["prompt"]
    assert schemas["ChatCompletionRequest"]["required"] == ["messages"]


def test_caps_are_in_the_schema(doc):
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert props["n"]["maximum"] == protocol.MAX_N
    assert props["best_of"]["maximum"] == protocol.MAX_BEST_OF
    assert props["logit_bias"]["maxProperties"] == protocol.MAX_LOGIT_BIAS
    assert props["stop_token_ids"]["maxItems"] == protocol.MAX_STOP_TOKEN_IDS
    string, strings, _ = props["stop"]["anyOf"]
    assert string["maxLength"] == strings["items"]["maxLength"] == protocol.MAX_STOP_STRING_CHARS
    assert strings["maxItems"] == protocol.MAX_STOP_STRINGS
    texts, ids, lists = props["prompt"]["anyOf"][1:]
    assert texts["maxItems"] == lists["maxItems"] == protocol.MAX_PROMPTS
    assert "maxItems" not in ids  # one prompt's token ids: the context bounds them
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["messages"]["maxItems"] == protocol.MAX_MESSAGES
    assert chat["tools"]["maxItems"] == protocol.MAX_TOOLS


def test_schema_and_model_agree_on_examples(doc):
    # What the schema's required fields make, the model takes; what breaks a cap, the
    # schema refuses as the model does.
    for name, model in [("CompletionRequest", protocol.CompletionRequest),
                        ("ChatCompletionRequest", protocol.ChatCompletionRequest),
                        ("TokenizeRequest", protocol.TokenizeRequest),
                        ("DetokenizeRequest", protocol.DetokenizeRequest)]:
        body = example(doc, {"$ref": REF + name})
        validator(doc, name).validate(body)
        model.model_validate_json(json.dumps(body))
    too_many = {"prompt": "hi", "stop": ["x"] * (protocol.MAX_STOP_STRINGS + 1)}
    assert not validator(doc, "CompletionRequest").is_valid(too_many)
    assert not validator(doc, "CompletionRequest").is_valid({"prompt": "hi", "n": 129})
    assert not validator(doc, "TokenizeRequest").is_valid({})
    assert not validator(doc, "CompletionRequest").is_valid({"prompt": "hi", "x": 1})


def test_without_api_key_no_security():
    doc = stub_app(None).openapi()
    assert "securitySchemes" not in doc.get("components", {})
    assert all("security" not in op for item in doc["paths"].values() for op in item.values())


def test_openapi_spec_validator_accepts_it(doc):
    validate = pytest.importorskip("openapi_spec_validator").validate
    validate(doc)


# ------------------------------------------------------------------ a real server


@pytest.fixture(scope="module")
def server(llama_dir):
    srv = ServerProcess(llama_dir, "--served-model-name", MODEL_NAME, "--api-key", API_KEY,
                        "--num-gpu-blocks", "64")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def served_doc(server) -> dict[str, Any]:
    r = httpx.get(f"{server.url}/openapi.json")  # open, like /health
    assert r.status_code == 200
    return r.json()


def test_served_document_is_the_apps(served_doc, doc):
    assert set(served_doc["paths"]) == set(doc["paths"])
    assert served_doc["components"]["schemas"] == doc["components"]["schemas"]


@pytest.mark.parametrize("path", [p for p, route in ROUTES.items() if route[1]])
def test_request_from_required_fields_is_accepted(server, served_doc, path):
    method, body_schema, ok, _, _ = ROUTES[path]
    body = example(served_doc, {"$ref": REF + body_schema})
    r = httpx.post(server.url + path, json=body, headers=HEADERS, timeout=60)
    assert r.status_code == 200, (body, r.text)
    validator(served_doc, ok).validate(r.json())


def check_stream(server, doc, path: str, body: dict[str, Any], event: str) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True},
                      headers=HEADERS, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r.iter_lines()))
    for e in events:
        validator(doc, event).validate(e)
    return events


def test_completion_responses_match_their_schemas(server, served_doc):
    body = {"prompt": "hello there", "max_tokens": 3, "logprobs": 2, "echo": True,
            "prompt_logprobs": 1, "stop": ["zzz"]}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=HEADERS, timeout=60)
    assert r.status_code == 200
    validator(served_doc, "CompletionResponse").validate(r.json())
    events = check_stream(server, served_doc, "/v1/completions",
                          {"prompt": "hello", "max_tokens": 3, "logprobs": 1,
                           "stream_options": {"include_usage": True}},
                          "CompletionStreamResponse")
    assert events[-1]["usage"]["completion_tokens"] == 3


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_chat_responses_match_their_schemas(server, served_doc):
    messages = [{"role": "user", "content": "hi"}]
    for body in [{"messages": messages, "max_tokens": 3, "logprobs": True, "top_logprobs": 2},
                 {"messages": messages, "max_tokens": 6, "tools": TOOLS, "tool_choice": NAMED}]:
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=HEADERS,
                       timeout=60)
        assert r.status_code == 200, r.text
        validator(served_doc, "ChatCompletionResponse").validate(r.json())
        check_stream(server, served_doc, "/v1/chat/completions",
                     {**body, "stream_options": {"include_usage": True}},
                     "ChatCompletionStreamResponse")
    message = r.json()["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"


def test_other_responses_match_their_schemas(server, served_doc):
    r = httpx.get(f"{server.url}/v1/models", headers=HEADERS)
    validator(served_doc, "ModelList").validate(r.json())
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "hi", "return_token_strs": True})
    validator(served_doc, "TokenizeResponse").validate(r.json())
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": r.json()["tokens"]})
    validator(served_doc, "DetokenizeResponse").validate(r.json())
    errors = [httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "model": "x"},
                         headers=HEADERS),
              httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}),
              httpx.post(f"{server.url}/v1/completions", json={"prompt": 5}, headers=HEADERS)]
    assert [e.status_code for e in errors] == [404, 401, 400]
    for e in errors:
        validator(served_doc, "ErrorResponse").validate(e.json())
