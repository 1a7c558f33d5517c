"""The ``rvllm serve`` flags, kept apart from the server so the CLI parses without
loading the server's (or torch's) modules."""

from __future__ import annotations

import argparse

from rvllm.cli_args import add_engine_args


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The ``rvllm serve`` flags: server options plus every engine flag, vLLM's names."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--served-model-name", default=None,
                   help="model name the API answers to (default: the --model argument)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on every /v1 route")
    g.add_argument("--shutdown-timeout", type=float, default=3.0,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas behind this server (requests go to the least loaded)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    g.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="do not log one line per HTTP request")
    add_engine_args(parser)
