"""The OpenAPI document's pieces: every request and response model's JSON schema, and
each route's request body and responses (``/openapi.json``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from rvllm.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)
from rvllm.server.protocol_pooling import (
    EmbeddingRequest,
    EmbeddingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from rvllm.server.protocol_responses import ResponsesRequest, ResponsesResponse

REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    CompletionRequest, ChatCompletionRequest, ResponsesRequest, EmbeddingRequest,
    ScoreRequest, RerankRequest, TokenizeRequest, DetokenizeRequest, LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest)


RESPONSE_MODELS: tuple[type[BaseModel], ...] = (
    CompletionResponse, CompletionStreamResponse, ChatCompletionResponse,
    ChatCompletionStreamResponse, ResponsesResponse, EmbeddingResponse, ScoreResponse,
    RerankResponse, ModelList, TokenizeResponse, DetokenizeResponse, ErrorResponse)


OPENAPI_REF = "#/components/schemas/{model}"


def openapi_schemas() -> dict[str, Any]:
    """The JSON schemas of the request and response models (and of every model they
    hold), by name, with ``$ref``s into an OpenAPI document's ``components/schemas``.
    Requests are described as they are validated, responses as they are written."""
    inputs = [(m, "validation") for m in REQUEST_MODELS]
    outputs = [(m, "serialization") for m in RESPONSE_MODELS]
    _, schema = models_json_schema(inputs + outputs, ref_template=OPENAPI_REF)  # type: ignore[arg-type]
    return dict(schema.get("$defs", {}))


def schema_ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": OPENAPI_REF.format(model=model.__name__)}


def openapi_request_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's ``openapi_extra``: its JSON body is ``model``. (The routes read the raw
    body and validate it themselves, so that every error keeps OpenAI's shape.)"""
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema_ref(model)}}}}


ERROR_DESCRIPTIONS = {
    400: "Invalid request: malformed JSON, a wrong type, a value out of range or past a "
         "size cap, an unknown field, or a prompt longer than the context",
    401: "Missing or wrong API key (only with --api-key)",
    404: "The model is not the one served",
    413: "The request body is larger than --max-request-body-bytes",
    503: "The engine is not running, or too many requests are waiting "
         "(--max-waiting-requests; then with Retry-After)",
}


def openapi_responses(ok: type[BaseModel] | None, errors: tuple[int, ...],
                      stream: type[BaseModel] | None = None,
                      ok_description: str = "Successful Response",
                      descriptions: dict[int, str] | None = None) -> dict[int | str, Any]:
    """A route's ``responses``: ``ok`` as JSON (and ``stream``'s events, with ``stream:
    true``), and ``ErrorResponse`` under each status of ``errors`` (described as in
    ``ERROR_DESCRIPTIONS``, or ``descriptions``)."""
    responses: dict[int | str, Any] = {}
    if ok is not None:
        content: dict[str, Any] = {"application/json": {"schema": schema_ref(ok)}}
        if stream is not None:
            content["text/event-stream"] = {"schema": schema_ref(stream)}
            ok_description += (f". With stream: true, Server-Sent Events instead: each "
                               f"`data: <{stream.__name__} JSON>`, the last `data: [DONE]`")
        responses[200] = {"description": ok_description, "content": content}
    for status in errors:
        responses[status] = {"description": (descriptions or {}).get(
                                 status, ERROR_DESCRIPTIONS[status]),
                             "content": {"application/json": {
                                 "schema": schema_ref(ErrorResponse)}}}
    if 503 in errors and stream is not None:
        responses[503]["headers"] = {"Retry-After": {
            "description": "seconds to wait, when the server is overloaded",
            "schema": {"type": "integer"}}}
    return responses


def complete_openapi(doc: dict[str, Any], api_key: bool) -> dict[str, Any]:
    """FastAPI's document for the app, with the request and response schemas the routes
    refer to, and (with an API key) bearer authentication on every /v1 route."""
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name, schema in openapi_schemas().items():
        if schemas.setdefault(name, schema) != schema:
            raise ValueError(f"two OpenAPI schemas are named {name}")
    if api_key:
        doc["components"]["securitySchemes"] = {"bearerAuth": {"type": "http",
                                                               "scheme": "bearer"}}
        for path, operations in doc.get("paths", {}).items():
            if path.startswith("/v1"):
                for operation in operations.values():
                    operation["security"] = [{"bearerAuth": []}]
    return doc
