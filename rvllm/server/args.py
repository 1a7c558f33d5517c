"""The ``rvllm serve`` flags, kept apart from the server so the CLI parses without
loading the server's (or torch's) modules."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rvllm.cli_args import add_engine_args

# The --tool-call-parser names (server/tool_parsers.py's TOOL_PARSERS, kept here so the
# CLI parses without importing the server).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
# The --reasoning-parser names (server/reasoning_parsers.py's REASONING_PARSERS).
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The ``rvllm serve`` flags: server options plus every engine flag, vLLM's names."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--served-model-name", default=None, nargs="+", metavar="NAME",
                   help="model name(s) the API answers to; responses carry the first "
                        "(default: the --model argument)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on every /v1 route")
    g.add_argument("--allowed-origins", type=_json_list, default=["*"],
                   help='CORS: origins allowed, a JSON list (default: ["*"])')
    g.add_argument("--allowed-methods", type=_json_list, default=["*"],
                   help='CORS: methods allowed, a JSON list (default: ["*"])')
    g.add_argument("--allowed-headers", type=_json_list, default=["*"],
                   help='CORS: request headers allowed, a JSON list (default: ["*"])')
    g.add_argument("--allow-credentials", action="store_true",
                   help="CORS: allow credentials (cookies, Authorization) in cross-origin "
                        "requests")
    g.add_argument("--shutdown-timeout", type=float, default=3.0,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas behind this server (requests go to the least loaded)")
    g.add_argument("--disable-frontend-multiprocessing", action="store_true",
                   help="run the engine in the server's process (by default it has a "
                        "process of its own, which loads the model while the server starts)")
    g.add_argument("--max-request-body-bytes", type=int, default=None,
                   help="larger request bodies get 413 before they are read (default: 64 "
                        "bytes per token of --max-model-len, at least 4 MiB)")
    g.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="requests that may wait for the engine; past them a request gets "
                        "503 with Retry-After (0: no limit)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="do not log the throughput, queue and cache line every 10 s "
                        "(RVLLM_LOG_STATS_INTERVAL seconds)")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage.prompt_tokens_details.cached_tokens: the prompt tokens the "
                        "prefix cache had")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) to serve, with --enable-lora: a "
                        "request whose model is NAME runs with PATH's adapter (also vLLM's "
                        'JSON form, \'{"name": ..., "path": ...}\')')
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help='logprobs name each token as "token_id:<id>" rather than its text '
                        "(for tokens that are not whole characters); a request's "
                        "return_tokens_as_token_ids overrides it")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide to call tools (tool_choice "auto"): its calls '
                        "are read out of its text by --tool-call-parser")
    g.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                   help="how the model writes tool calls: hermes (Qwen2.5/3, Hermes, "
                        "SmolLM2's <tool_call> form), llama3_json (Llama 3.1/3.2), mistral")
    g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split chat output into reasoning (<think>...</think>) and content: "
                        "deepseek_r1 (DeepSeek-R1 and its distills, QwQ), qwen3")
    g.add_argument("--disable-dashboard", action="store_true",
                   help="do not serve the live dashboard (/dashboard) and its data "
                        "(/v1/engine/stats)")
    g.add_argument("--dashboard-show-prompts", action="store_true",
                   help="show the start of each live request's prompt on the dashboard "
                        "(to whoever may read /v1/engine/stats)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    g.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="do not log one line per HTTP request")
    add_engine_args(parser)


def _json_list(text: str) -> list[str]:
    """A flag's JSON list of strings: '["http://a.example", "http://b.example"]'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text}")
    return value


def cors_options(ns: argparse.Namespace) -> dict[str, Any]:
    """The CORS flags as ``build_app``'s ``cors`` argument."""
    return {"allowed_origins": ns.allowed_origins, "allowed_methods": ns.allowed_methods,
            "allowed_headers": ns.allowed_headers, "allow_credentials": ns.allow_credentials}


def serve_engine_args(ns: argparse.Namespace):  # noqa: ANN201 - EngineArgs
    """The engine's arguments for ``rvllm serve``: the flags, and, for an engine in a
    process of its own, the weights' packing left for its idle time, so the server
    answers sooner after launch. (An engine in the server's process packs them before it
    is up: packing later would hold the GIL while the server starts.)"""
    from rvllm.cli_args import engine_args_from_namespace

    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                         f"{', '.join(TOOL_CALL_PARSERS)}).")
    args = engine_args_from_namespace(ns)
    args.defer_weight_packing = not ns.disable_frontend_multiprocessing
    return args


def start_engine_process(ns: argparse.Namespace):  # noqa: ANN201 - ProcessEngine | None
    """Start ``rvllm serve``'s engine process, unless the engine runs in the server's
    process (``--disable-frontend-multiprocessing``) or as replicas (``-dp`` > 1).

    Called before the server imports anything heavy: the child imports torch and loads
    the model on one core while this process imports the web stack and loads its
    tokenizer on another (neither needs the other), so launch to ``/health`` is the
    longer of the two instead of their sum. Returns without waiting for the model."""
    if ns.disable_frontend_multiprocessing or ns.data_parallel_size != 1:
        return None
    import logging
    import multiprocessing
    import sys
    import threading

    from rvllm.engine.process_start import start_engine_child

    args = serve_engine_args(ns)
    # Forking is safe this early (no torch, no CUDA, no thread but this one) and spares
    # the child a fresh interpreter's start; spawn otherwise.
    fork = ("fork" in multiprocessing.get_all_start_methods() and "torch" not in sys.modules
            and threading.active_count() == 1)
    started = start_engine_child(args, None, logging.INFO, "fork" if fork else "spawn")
    from rvllm.engine.process_engine import ProcessEngine

    return ProcessEngine(args, started=started)
