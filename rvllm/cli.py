"""The ``rvllm`` command: serve | generate | chat | benchmark | bench."""

from __future__ import annotations

import argparse
import sys
import time

from rvllm.cli_args import (
    add_engine_args,
    add_sampling_args,
    engine_args_from_namespace,
    sampling_params_from,
)
from rvllm.startup import resume_collector


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rvllm", description="rvllm: LLM inference and serving engine"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print the result")
    add_engine_args(gen)
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt in the model's chat template as a user message")
    add_sampling_args(gen, max_tokens=128)

    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    add_engine_args(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    add_sampling_args(chat, max_tokens=512)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    from rvllm.server.args import add_serve_args

    add_serve_args(serve)

    from rvllm.bench.cli import add_bench_parsers

    add_bench_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command != "bench":  # the bench commands load no engine
        from rvllm.startup import pause_collector

        pause_collector()  # until the engine is up: see rvllm.startup
    try:
        if args.command == "serve":
            from rvllm.server.args import start_engine_process

            started = start_engine_process(args)  # first: it loads while the server starts
            from rvllm.server.app import run_server

            run_server(args, started)
            return 0
        if args.command == "generate":
            return _generate(args)
        if args.command == "chat":
            from rvllm.chat import run_chat

            return run_chat(args)
        if args.command in ("benchmark", "bench"):
            from rvllm.bench.cli import run_bench_command

            return run_bench_command(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"rvllm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        resume_collector(freeze=False)  # if the command ended before its engine was up
    return 0


def _load_engine(args: argparse.Namespace):  # noqa: ANN202 - LLMEngine
    from rvllm.engine.llm_engine import LLMEngine

    start = time.perf_counter()
    engine = LLMEngine(engine_args_from_namespace(args))
    resume_collector()
    print(f"Loaded {engine.model_config.path} in {time.perf_counter() - start:.2f}s",
          file=sys.stderr)
    return engine


def _generate(args: argparse.Namespace) -> int:
    params = sampling_params_from(args)
    engine = _load_engine(args)
    prompt: str | list[int] = args.prompt
    if args.chat:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    request_id = engine.add_request(None, prompt, params)
    printed = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            text = out.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
