"""The OpenAI-compatible HTTP server (``rvllm serve``): FastAPI routes over an AsyncEngine.

Start it with ``rvllm serve --model DIR`` or ``python -m rvllm.server.app --model DIR``.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send

import rvllm
from rvllm.engine.async_engine import AsyncEngine
from rvllm.engine.data_parallel import DataParallelEngine
from rvllm.engine.process_engine import ProcessEngine
from rvllm.server.args import add_serve_args, serve_engine_args, start_engine_process
from rvllm.server.errors import APIError, error_body, install_error_handlers
from rvllm.server.metrics import ServerMetrics
from rvllm.server.protocol import DetokenizeRequest, TokenizeRequest
from rvllm.server.serving_chat import ChatServing, render_chat_prompt
from rvllm.server.serving_completion import CompletionServing
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


def build_app(engine: AsyncEngine, served_model_name: str, api_key: str | None,
              tool_call_parser: str | None = None,
              enable_auto_tool_choice: bool = False) -> FastAPI:
    """The FastAPI app serving ``engine`` under ``served_model_name``. The engine is shut
    down with the app. ``tool_call_parser`` reads tool calls out of the text of requests
    whose ``tool_choice`` is ``auto``, with ``enable_auto_tool_choice``."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        engine.shutdown()

    app = FastAPI(title="rvllm", version=rvllm.__version__, lifespan=lifespan)
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    completions = CompletionServing(engine, served_model_name)
    chat = ChatServing(engine, served_model_name, tool_call_parser, enable_auto_tool_choice)
    metrics = ServerMetrics(engine, served_model_name)
    started = int(time.time())

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        return await completions.create(await request.body(), request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        return await chat.create(await request.body(), request)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": started,
            "owned_by": "rvllm", "root": engine.model_path, "parent": None,
            "max_model_len": engine.max_model_len,
        }]}

    @app.get("/health")
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

    @app.post("/tokenize")
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

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, str]:
        req = DetokenizeRequest.model_validate_json(await request.body())
        completions.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise APIError(f"token ids must be in [0, {engine.vocab_size}); got {bad[0]}.",
                           param="tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    return app


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
                                                    ns.enable_auto_tool_choice))
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
                                               ns.enable_auto_tool_choice))
    replicas = engine.replicas if isinstance(engine, DataParallelEngine) else [engine]
    resume_collector()
    for replica in replicas:
        # A dead worker ends the server (its requests were already failed).
        replica.on_fatal = lambda _error: os.kill(os.getpid(), signal.SIGTERM)
    logger.info("serving %s on http://%s:%d/v1", name, ns.host, ns.port)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled
        pass
    finally:
        engine.shutdown()


def served_name(ns: argparse.Namespace, model_path: str) -> str:
    """The model's name in the API: ``--served-model-name``, else ``--model`` as given,
    else the file or directory name of the built-in default."""
    return ns.served_model_name or ns.model or Path(model_path).name


def http_server(ns: argparse.Namespace, app: FastAPI) -> uvicorn.Server:
    """uvicorn's server for ``app``, its protocol modules already imported (``load``)."""
    config = uvicorn.Config(
        app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level,
        access_log=not ns.disable_uvicorn_access_log,
        timeout_graceful_shutdown=ns.shutdown_timeout,  # type: ignore[arg-type]
    )
    config.load()
    return uvicorn.Server(config)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rvllm serve",
                                     description="OpenAI-compatible server for an rvllm model.")
    add_serve_args(parser)
    ns = parser.parse_args(argv)
    run_server(ns, start_engine_process(ns))


if __name__ == "__main__":
    main()
