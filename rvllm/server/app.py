"""The OpenAI-compatible HTTP server (``rvllm serve``): FastAPI routes over an AsyncEngine.

Start it with ``rvllm serve --model DIR`` or ``python -m rvllm.server.app --model DIR``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

import rvllm
from rvllm.engine.async_engine import AsyncEngine
from rvllm.engine.data_parallel import DataParallelEngine
from rvllm.engine.process_engine import ProcessEngine
from rvllm.lora.request import LoRARequest, parse_lora_modules
from rvllm.server.args import (
    add_serve_args,
    cors_options,
    serve_engine_args,
    start_engine_process,
)
from rvllm.server.dashboard import Dashboard
from rvllm.server.errors import APIError, error_body, install_error_handlers
from rvllm.server.limits import BodyLimitMiddleware, default_max_body_bytes
from rvllm.server.metrics import ServerMetrics
from rvllm.server.openapi import complete_openapi, openapi_request_body, openapi_responses
from rvllm.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DetokenizeRequest,
    DetokenizeResponse,
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
from rvllm.server.serving import ServingBase
from rvllm.server.serving_chat import ChatServing, render_chat_prompt
from rvllm.server.serving_completion import CompletionServing
from rvllm.server.serving_embedding import EmbeddingServing
from rvllm.server.serving_responses import ResponsesServing
from rvllm.server.stats_log import StatsLogger, log_stats_interval
from rvllm.startup import resume_collector

logger = logging.getLogger("rvllm")


class APIKeyMiddleware:
    """With ``--api-key``, every /v1 route wants ``Authorization: Bearer <key>``."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") \
                and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                message = ("Missing API key: send 'Authorization: Bearer <key>'." if not given
                           else "Incorrect API key provided.")
                body = error_body(message, 401, None, "invalid_api_key")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# CORSMiddleware's options under vLLM's flag names (args.cors_options), with its defaults.
CORS_DEFAULTS: dict[str, Any] = {"allowed_origins": ["*"], "allowed_methods": ["*"],
                                 "allowed_headers": ["*"], "allow_credentials": False}


def cors_middleware_options(cors: dict[str, Any]) -> dict[str, Any]:
    """Starlette's CORSMiddleware keywords from ``build_app``'s ``cors``."""
    unknown = set(cors) - set(CORS_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown CORS options: {', '.join(sorted(unknown))} "
                         f"(known: {', '.join(CORS_DEFAULTS)})")
    options = {**CORS_DEFAULTS, **cors}
    return {"allow_origins": list(options["allowed_origins"]),
            "allow_methods": list(options["allowed_methods"]),
            "allow_headers": list(options["allowed_headers"]),
            "allow_credentials": bool(options["allow_credentials"])}


def build_app(engine: AsyncEngine, served_model_name: str | list[str], api_key: str | None,
              tool_call_parser: str | None = None,
              enable_auto_tool_choice: bool = False,
              cors: dict[str, Any] | None = None, dashboard: bool = True,
              dashboard_show_prompts: bool = False,
              reasoning_parser: str | None = None,
              default_sampling: dict[str, Any] | None = None,
              prompt_tokens_details: bool = False,
              return_tokens_as_token_ids: bool = False,
              lora_modules: list[LoRARequest] | None = None,
              lora_runtime_updates: bool = False,
              log_stats_interval_s: float | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` under ``served_model_name``. The engine is shut
    down with the app. ``tool_call_parser`` reads tool calls out of the text of requests
    whose ``tool_choice`` is ``auto``, with ``enable_auto_tool_choice``. ``cors``
    (``args.cors_options``: ``allowed_origins``, ``allowed_methods``, ``allowed_headers``,
    ``allow_credentials``, each defaulting as vLLM's flags do) puts Starlette's
    CORSMiddleware in front of every route; None leaves CORS out. ``dashboard`` serves the
    live dashboard (``/dashboard`` and ``/v1/engine/stats``), with the prompts of the
    live requests if ``dashboard_show_prompts``. ``reasoning_parser`` splits chat output
    into ``reasoning`` and ``content``. ``default_sampling`` (``EngineArgs.sampling_defaults``)
    fills the sampling fields a request leaves unset. ``prompt_tokens_details`` puts the
    prefix cache's share of the prompt in ``usage``. ``return_tokens_as_token_ids`` names
    logprobs' tokens by id unless a request says otherwise. ``lora_modules``: LoRA adapters
    a request's ``model`` may name (the engine started with LoRA enabled);
    ``lora_runtime_updates`` adds the routes that load and unload them by name.
    ``log_stats_interval_s``: log the stats line that often (``stats_log``); None: never."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        stats = (None if log_stats_interval_s is None else
                 asyncio.create_task(StatsLogger().run(engine, log_stats_interval_s)))
        yield
        if stats is not None:
            stats.cancel()
        engine.shutdown()

    app = FastAPI(title="rvllm", version=rvllm.__version__, lifespan=lifespan)
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    if cors is not None:
        # Outside the API-key check, so that a 401 carries the headers a browser needs to
        # read it; preflights (OPTIONS) are answered here and never reach the routes.
        app.add_middleware(CORSMiddleware, **cors_middleware_options(cors))
    names = [served_model_name] if isinstance(served_model_name, str) else served_model_name
    served_model_name = names[0]  # what responses, metrics and the dashboard carry
    metrics = ServerMetrics(engine, served_model_name)
    board = (Dashboard(engine, metrics, served_model_name, dashboard_show_prompts)
             if dashboard else None)
    # The endpoints' engine: with the dashboard, one that also notes each request added.
    serving_engine: Any = engine if board is None else board.track()
    completions = CompletionServing(serving_engine, names, default_sampling)
    chat = ChatServing(serving_engine, names, tool_call_parser,
                       enable_auto_tool_choice, reasoning_parser, default_sampling)
    embeddings = EmbeddingServing(serving_engine, names)
    responses = ResponsesServing(serving_engine, names, default_sampling, reasoning_parser,
                                 chat)
    completions.prompt_tokens_details = chat.prompt_tokens_details = prompt_tokens_details
    completions.tokens_as_ids = chat.tokens_as_ids = return_tokens_as_token_ids
    loras = {m.lora_name: m for m in lora_modules or []}
    completions.lora_modules = chat.lora_modules = responses.lora_modules = loras
    embeddings.prompt_tokens_details = prompt_tokens_details
    started = int(time.time())
    fastapi_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        # The routes read their bodies themselves; the schemas their $refs name are added
        # to FastAPI's document here, once.
        if app.openapi_schema is None:
            app.openapi_schema = complete_openapi(fastapi_openapi(), bool(api_key))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    generation_errors = (400, 401, 404, 413, 503)

    @app.post("/v1/completions", response_model=None,
              openapi_extra=openapi_request_body(CompletionRequest),
              responses=openapi_responses(CompletionResponse, generation_errors,
                                          stream=CompletionStreamResponse))
    async def create_completion(request: Request) -> Response:
        return await completions.create(await request.body(), request)

    @app.post("/v1/chat/completions", response_model=None,
              openapi_extra=openapi_request_body(ChatCompletionRequest),
              responses=openapi_responses(ChatCompletionResponse, generation_errors,
                                          stream=ChatCompletionStreamResponse))
    async def create_chat_completion(request: Request) -> Response:
        return await chat.create(await request.body(), request)

    @app.post("/v1/responses", response_model=None,
              openapi_extra=openapi_request_body(ResponsesRequest),
              responses=openapi_responses(ResponsesResponse, generation_errors,
                                          ok_description="One assistant message. With "
                                          "stream: true, the Responses API's Server-Sent "
                                          "Events instead (response.created, "
                                          "response.output_text.delta, ..., "
                                          "response.completed)"))
    async def create_response(request: Request) -> Response:
        return await responses.create(await request.body(), request)

    @app.post("/v1/embeddings", response_model=None,
              openapi_extra=openapi_request_body(EmbeddingRequest),
              responses=openapi_responses(EmbeddingResponse, generation_errors,
                                          ok_description="One vector per input, from a "
                                          "pooling model (--runner pooling)"))
    async def create_embedding(request: Request) -> Response:
        return await embeddings.create(await request.body(), request)

    for path in ("/score", "/v1/score"):
        app.add_api_route(path, _route(embeddings.score), methods=["POST"],
                          response_model=None, openapi_extra=openapi_request_body(ScoreRequest),
                          responses=openapi_responses(
                              ScoreResponse, generation_errors, ok_description="The cosine "
                              "similarity of each pair's embeddings (a pooling model's)"))
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_api_route(path, _route(embeddings.rerank), methods=["POST"],
                          response_model=None, openapi_extra=openapi_request_body(RerankRequest),
                          responses=openapi_responses(
                              RerankResponse, generation_errors, ok_description="The "
                              "documents by the cosine similarity of their embeddings to the "
                              "query's, best first (a pooling model's)"))

    @app.get("/v1/models", response_model=None, responses=openapi_responses(ModelList, (401,)))
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": started,
            "owned_by": "rvllm", "root": engine.model_path, "parent": None,
            "max_model_len": engine.max_model_len,
        } for name in names] + [{
            "id": lora.lora_name, "object": "model", "created": started,
            "owned_by": "rvllm", "root": lora.lora_path, "parent": served_model_name,
            "max_model_len": engine.max_model_len,
        } for lora in loras.values()]}

    @app.get("/health", responses=openapi_responses(
        None, (503,), descriptions={503: "The engine loop is not running"}))
    async def health() -> Response:
        if not engine.is_running:
            raise APIError("The engine loop is not running.", 503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": rvllm.__version__}

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", response_model=None, openapi_extra=openapi_request_body(TokenizeRequest),
              responses=openapi_responses(TokenizeResponse, (400, 404, 413)))
    async def tokenize(request: Request) -> dict[str, Any]:
        req = TokenizeRequest.model_validate_json(await request.body())
        completions.check_model(req.model)
        tokenizer = engine.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise APIError("Give exactly one of 'prompt' and 'messages'.", param="prompt")
        if req.messages is not None:
            ids = render_chat_prompt(
                tokenizer, req.messages,
                req.add_generation_prompt and not req.continue_final_message,
                req.continue_final_message, None, None)
        else:
            ids = tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
        strs = ([tokenizer.decode([t], skip_special_tokens=False) for t in ids]
                if req.return_token_strs else None)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                "token_strs": strs}

    @app.post("/detokenize", response_model=None,
              openapi_extra=openapi_request_body(DetokenizeRequest),
              responses=openapi_responses(DetokenizeResponse, (400, 404, 413)))
    async def detokenize(request: Request) -> dict[str, str]:
        req = DetokenizeRequest.model_validate_json(await request.body())
        completions.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise APIError(f"token ids must be in [0, {engine.vocab_size}); got {bad[0]}.",
                           param="tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    if lora_runtime_updates:
        add_lora_routes(app, loras)
    if board is not None:
        board.add_routes(app)
    return app


def add_lora_routes(app: FastAPI, loras: dict[str, LoRARequest]) -> None:
    """vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``: a name added to
    or taken from the adapters requests may name (the engine reads an adapter on its
    first request, and drops the least recently used idle one past --max-cpu-loras).
    Every adapter gets a new id, so a name loaded again never meets its old weights."""
    next_id = [max((m.lora_int_id for m in loras.values()), default=0) + 1]

    @app.post("/v1/load_lora_adapter", response_model=None,
              openapi_extra=openapi_request_body(LoadLoRAAdapterRequest),
              responses=openapi_responses(None, (400, 401)))
    async def load_lora_adapter(request: Request) -> Response:
        req = LoadLoRAAdapterRequest.model_validate_json(await request.body())
        if req.lora_name in loras:
            raise APIError(f"The LoRA adapter {req.lora_name!r} has already been loaded.",
                           param="lora_name")
        if not (Path(req.lora_path).expanduser() / "adapter_config.json").is_file():
            raise APIError(f"{req.lora_path} holds no adapter_config.json (a PEFT LoRA "
                           "folder).", param="lora_path")
        loras[req.lora_name] = LoRARequest(req.lora_name, next_id[0], req.lora_path)
        next_id[0] += 1
        return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.",
                        media_type="text/plain")

    @app.post("/v1/unload_lora_adapter", response_model=None,
              openapi_extra=openapi_request_body(UnloadLoRAAdapterRequest),
              responses=openapi_responses(None, (400, 401, 404)))
    async def unload_lora_adapter(request: Request) -> Response:
        req = UnloadLoRAAdapterRequest.model_validate_json(await request.body())
        if loras.pop(req.lora_name, None) is None:
            raise APIError(f"The LoRA adapter {req.lora_name!r} cannot be found.", 404,
                           param="lora_name", code="model_not_found")
        return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.",
                        media_type="text/plain")


def _route(handler: Callable[[bytes, Request], Awaitable[Response]]
           ) -> Callable[[Request], Awaitable[Response]]:
    """A POST route that hands its raw body to ``handler``."""
    async def route(request: Request) -> Response:
        return await handler(await request.body(), request)

    return route


def run_server(ns: argparse.Namespace, started: ProcessEngine | None = None) -> None:
    """Load the engine, then serve until SIGINT/SIGTERM. ``started``: the engine process
    ``start_engine_process`` started, still loading its model."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    engine: AsyncEngine | DataParallelEngine | ProcessEngine
    if started is not None:
        try:
            # While the child loads the model: the tokenizer, the app and the HTTP server's
            # modules (50-75 ms here), so that its readiness is all that is left.
            started.load_tokenizer()
            name = served_name(ns, started.args.resolve_model())
            server = http_server(ns, build_app(started, name, ns.api_key, ns.tool_call_parser,
                                               ns.enable_auto_tool_choice,
                                               **app_options(ns)), started)
            started.wait_ready()
        except BaseException:
            started.shutdown(timeout=5.0)
            raise
        engine = started
    else:
        if ns.data_parallel_size > 1:
            engine = DataParallelEngine.from_engine_args(serve_engine_args(ns),
                                                         ns.data_parallel_size)
        else:
            engine = AsyncEngine.from_engine_args(serve_engine_args(ns))
        name = served_name(ns, engine.model_path)
        server = http_server(ns, build_app(engine, name, ns.api_key, ns.tool_call_parser,
                                           ns.enable_auto_tool_choice,
                                           **app_options(ns)), engine)
    replicas = engine.replicas if isinstance(engine, DataParallelEngine) else [engine]
    resume_collector()
    for replica in replicas:
        # A dead worker ends the server (its requests were already failed).
        replica.on_fatal = lambda _error: os.kill(os.getpid(), signal.SIGTERM)
    logger.info("serving %s on http://%s:%d/v1", ", ".join(name), ns.host, ns.port)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled
        pass
    finally:
        engine.shutdown()


def app_options(ns: argparse.Namespace) -> dict[str, Any]:
    """``build_app``'s CORS, dashboard, reasoning-parser and sampling-default options
    from the flags."""
    from rvllm.cli_args import engine_args_from_namespace

    return {"cors": cors_options(ns), "dashboard": not ns.disable_dashboard,
            "dashboard_show_prompts": ns.dashboard_show_prompts,
            "reasoning_parser": ns.reasoning_parser,
            "prompt_tokens_details": ns.enable_prompt_tokens_details,
            "return_tokens_as_token_ids": ns.return_tokens_as_token_ids,
            "lora_modules": lora_modules(ns),
            "lora_runtime_updates": ns.enable_lora and os.environ.get(
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
            "log_stats_interval_s": log_stats_interval(ns.disable_log_stats),
            "default_sampling": engine_args_from_namespace(ns).sampling_defaults()}


def lora_modules(ns: argparse.Namespace) -> list[LoRARequest]:
    """``--lora-modules``, each folder checked for its adapter_config.json (the engine
    reads the adapter on its first request); ValueError names what is wrong."""
    modules = parse_lora_modules(ns.lora_modules)
    if modules and not ns.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora.")
    for m in modules:
        if not (Path(m.lora_path).expanduser() / "adapter_config.json").is_file():
            raise ValueError(f"--lora-modules {m.lora_name}: {m.lora_path} holds no "
                             "adapter_config.json (a PEFT LoRA folder).")
    return modules


def served_name(ns: argparse.Namespace, model_path: str) -> list[str]:
    """The model's name in the API: ``--served-model-name``, else ``--model`` as given,
    else the file or directory name of the built-in default."""
    return ns.served_model_name or [ns.model or Path(model_path).name]


def http_server(ns: argparse.Namespace, app: FastAPI, engine: Any) -> uvicorn.Server:
    """uvicorn's server for ``app``, its protocol modules already imported (``load``), with
    the body-size limit in front of it."""
    limit = ns.max_request_body_bytes
    ServingBase.max_waiting_requests = ns.max_waiting_requests
    app.add_middleware(BodyLimitMiddleware, max_bytes=lambda: limit or default_max_body_bytes(
        engine.max_model_len))
    config = uvicorn.Config(
        app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level,
        access_log=not ns.disable_uvicorn_access_log,
        timeout_graceful_shutdown=ns.shutdown_timeout,  # type: ignore[arg-type]
    )
    config.load()
    return _DrainingServer(config, engine, ns.shutdown_timeout)


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, whose shutdown (SIGINT/SIGTERM) stops taking connections and
    gives the requests in flight ``--shutdown-timeout`` seconds to finish; just before
    that runs out, the engine is stopped, so the streams still open end with an error
    event and ``[DONE]`` instead of being cut off mid-stream."""

    def __init__(self, config: uvicorn.Config, engine: Any, grace: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.grace = grace

    async def shutdown(self, sockets: Any = None) -> None:
        margin = min(1.0, self.grace / 4)
        timer = asyncio.get_running_loop().call_later(
            max(0.0, self.grace - margin), self._end_the_rest)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _end_the_rest(self) -> None:
        logger.info("shutdown: ending the requests still in flight")
        threading.Thread(target=self.engine.shutdown, name="rvllm-drain", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rvllm serve",
                                     description="OpenAI-compatible server for an rvllm model.")
    add_serve_args(parser)
    ns = parser.parse_args(argv)
    try:
        run_server(ns, start_engine_process(ns))
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # as `rvllm serve` tells it
        print(f"rvllm serve: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
