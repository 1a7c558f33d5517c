"""``rvllm chat``: an interactive terminal conversation that streams tokens as they come."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO


def run_chat(args: argparse.Namespace, stdin: TextIO | None = None,
             stdout: TextIO | None = None) -> int:
    from rvllm.cli_args import engine_args_from_namespace, sampling_params_from
    from rvllm.engine.llm_engine import LLMEngine
    from rvllm.startup import resume_collector

    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    params = sampling_params_from(args)
    start = time.perf_counter()
    engine = LLMEngine(engine_args_from_namespace(args))
    resume_collector()
    print(f"Loaded {engine.model_config.path} in {time.perf_counter() - start:.2f}s. "
          "Type a message; Ctrl-D or Ctrl-C to quit.", file=sys.stderr)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = stdin.isatty()
    try:
        while True:
            if interactive:
                stdout.write(">>> ")
                stdout.flush()
            line = stdin.readline()
            if not line:
                break
            user = line.rstrip("\n")
            if not user.strip():
                continue
            messages.append({"role": "user", "content": user})
            reply = _stream_reply(engine, messages, params, stdout)
            messages.append({"role": "assistant", "content": reply})
    except KeyboardInterrupt:
        pass
    stdout.write("\n" if interactive else "")
    return 0


def _stream_reply(engine, messages, params, stdout: TextIO) -> str:  # noqa: ANN001
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    prompt_ids = engine.tokenizer.encode(text, add_special_tokens=False)
    request_id = engine.add_request(None, prompt_ids, params)
    reply = ""
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                new = out.outputs[0].text
                stdout.write(new[len(reply):])
                stdout.flush()
                reply = new
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        raise
    stdout.write("\n")
    stdout.flush()
    return reply
