"""Starting an engine process, with nothing heavy imported first.

``ProcessEngine`` drives the child once it runs; this module only starts it, so
``rvllm serve`` can fork it first thing (see ``server.args.start_engine_process``):
everything imported before the fork delays the child's own start.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

StartedChild = tuple[BaseProcess, Connection, Connection]


def start_engine_child(args: Any, num_threads: int | None, log_level: int,
                       start_method: str = "spawn") -> StartedChild:
    """Start an engine process for ``args`` (EngineArgs); returns it with the parent's ends
    of its two pipes (requests to it, outputs from it). ``start_method``: "spawn" (a fresh
    interpreter), or "fork" for a caller that has not imported torch or started a thread
    yet: the child then starts with the caller's imports instead of repeating them."""
    ctx = multiprocessing.get_context(start_method)
    child_requests, requests = ctx.Pipe(duplex=False)
    outputs, child_outputs = ctx.Pipe(duplex=False)
    # A forked child holds copies of the parent's ends too: it closes them first, or it
    # would never see EOF when the parent hangs up. (A spawned one gets only its own.)
    ours = (requests, outputs) if start_method == "fork" else ()
    # Not a daemon: a daemon may not start the tensor-parallel workers it may need.
    process = ctx.Process(target=_child_entry, name="rvllm-engine",
                          args=(ours, args, child_requests, child_outputs, num_threads,
                                log_level))
    process.start()
    child_requests.close()  # so the pipes report EOF when the child dies
    child_outputs.close()
    return process, requests, outputs


def _child_entry(parent_ends: tuple[Connection, ...], *args: Any) -> None:
    for end in parent_ends:
        end.close()
    from rvllm.deferred_imports import defer_torch_meta_registrations

    defer_torch_meta_registrations()  # this process's own: its engine imports them idle
    from rvllm.engine.process_wire import child_main

    child_main(*args)
