"""Data parallelism: N engine replicas behind one server, each request on the least loaded.

``from_engine_args`` gives every replica its own engine process (ProcessEngine:
its own model copy, KV cache and step loop; on GPUs its own device, on the CPU
its share of the cores). The server sees the same interface as one AsyncEngine:
requests go to the running replica with the fewest live requests, gauges and
counters are summed, and step observers (the metrics histograms) hear from every
replica. When a replica's process dies, its requests fail with EngineDeadError,
the others keep serving, and the replica is started again in the background.
In-process AsyncEngine replicas (``DataParallelEngine([AsyncEngine, ...])``) work
too; they are not restarted.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from typing import Any

from rvllm.config import EngineArgs, resolve_device
from rvllm.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineSnapshot,
    RequestStream,
    StepObserver,
)
from rvllm.engine.process_engine import ProcessEngine
from rvllm.inputs import PromptType
from rvllm.outputs import RequestOutput
from rvllm.pooling_params import PoolingParams
from rvllm.sampling_params import SamplingParams
from rvllm.tokenizer import Tokenizer

logger = logging.getLogger("rvllm")

Replica = AsyncEngine | ProcessEngine

# Counters that keep counting across a replica's restart (gauges start afresh).
_COUNTERS = ("prompt_tokens", "generation_tokens", "prefix_cache_queries",
             "prefix_cache_hits", "num_preemptions", "structured_output_requests",
             "grammar_compile_buckets", "grammar_compile_seconds", "grammar_compile_count",
             "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
             "spec_decode_num_accepted_tokens", "spec_decode_accepted_per_pos")


class DataParallelEngine:
    """Several engine replicas presented as one."""

    def __init__(self, replicas: list[Replica]) -> None:
        if not replicas:
            raise ValueError("data parallelism needs at least one replica.")
        self.replicas = replicas
        self.step_observers: list[StepObserver] = []
        self.restart_delay = 1.0  # seconds before retrying a replica that failed to start
        self._lock = threading.Lock()
        self._owner: dict[str, int] = {}  # live request id -> replica index
        self._load = [0] * len(replicas)
        self._retired = dict.fromkeys(_COUNTERS, 0)  # counters of replicas since replaced
        self._stopping = False
        self._starting: dict[int, ProcessEngine] = {}  # replicas being restarted
        for index, replica in enumerate(replicas):
            self._attach(index, replica)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, data_parallel_size: int) -> DataParallelEngine:
        """Start ``data_parallel_size`` engine processes side by side; raise the first
        start-up error (after stopping the others)."""
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {data_parallel_size}.")
        import torch

        device = resolve_device(args.device)
        if device.type == "cuda" and data_parallel_size > torch.cuda.device_count():
            raise ValueError(f"data_parallel_size={data_parallel_size} needs as many GPUs; "
                             f"{torch.cuda.device_count()} found.")
        threads = None
        if device.type == "cpu":
            threads = max(1, (os.cpu_count() or 1) // data_parallel_size)
        replicas = []
        for rank in range(data_parallel_size):
            replica_args = dataclasses.replace(args)
            if device.type == "cuda":
                replica_args.device = f"cuda:{rank}"
            replicas.append(ProcessEngine(replica_args, threads))
        try:
            for replica in replicas:
                replica.wait_ready()
        except BaseException:
            for replica in replicas:
                replica.shutdown(timeout=5.0)
            raise
        return cls(replicas)

    # -------------------------------------------------------- AsyncEngine's face

    @property
    def tokenizer(self) -> Tokenizer:
        return self.replicas[0].tokenizer

    @property
    def max_model_len(self) -> int:
        return self.replicas[0].max_model_len

    @property
    def vocab_size(self) -> int:
        return self.replicas[0].vocab_size

    @property
    def model_path(self) -> str:
        return self.replicas[0].model_path

    @property
    def runner_type(self) -> str:
        """What the model runs as: "generate" or "pooling" (embeddings)."""
        return self.replicas[0].runner_type

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The token ids that end a sequence (unless a request ignores EOS)."""
        return self.replicas[0].eos_token_ids

    @property
    def is_running(self) -> bool:
        """True while some replica can take requests (others may be restarting)."""
        return not self._stopping and any(r.is_running for r in self.replicas)

    async def add_request(self, request_id: str, prompt: PromptType,
                          params: SamplingParams | PoolingParams,
                          final_only: bool = False) -> RequestStream:
        tried: set[int] = set()
        while True:
            index, replica = self._route(request_id, tried)
            try:
                return await replica.add_request(request_id, prompt, params, final_only)
            except EngineDeadError:
                self._release(request_id)
                if replica.is_running:
                    raise
                tried.add(index)  # it died before taking the request: try another
            except BaseException:
                self._release(request_id)
                raise

    # The same stream loop as one engine's, over this class's add_request and abort.
    generate = AsyncEngine.generate

    def abort(self, request_id: str) -> None:
        with self._lock:
            index = self._owner.get(request_id)
            replica = self.replicas[index] if index is not None else None
        if replica is not None:
            replica.abort(request_id)

    def snapshot(self) -> EngineSnapshot:
        with self._lock:
            replicas = list(self.replicas)
            retired = dict(self._retired)
        snaps = [r.snapshot() for r in replicas]
        total = EngineSnapshot(**{f.name: functools.reduce(_plus, (getattr(s, f.name)
                                                                  for s in snaps))
                                  for f in dataclasses.fields(EngineSnapshot)})
        for name, value in retired.items():
            setattr(total, name, _plus(getattr(total, name), value))
        total.max_loras = max(s.max_loras for s in snaps)  # a setting, not a count
        blocks = max(1, total.num_blocks)
        total.kv_cache_usage = 1.0 - total.num_free_blocks / blocks
        return total

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopping = True
            replicas = list(self.replicas) + list(self._starting.values())
        # All at once: each ends its streams first, then waits for its process.
        stops = [threading.Thread(target=r.shutdown, args=(timeout,), daemon=True)
                 for r in replicas]
        for t in stops:
            t.start()
        for t in stops:
            t.join()

    def replica_loads(self) -> list[int]:
        """Live requests per replica (for tests and logs)."""
        with self._lock:
            return list(self._load)

    # ---------------------------------------------------------------- internals

    def _route(self, request_id: str, tried: set[int]) -> tuple[int, Replica]:
        with self._lock:
            if request_id in self._owner:
                raise ValueError(f"request id {request_id!r} is already in use.")
            live = [i for i, r in enumerate(self.replicas) if r.is_running and i not in tried]
            if not live:
                raise EngineDeadError("no engine replica is running (restarting).")
            index = min(live, key=self._load.__getitem__)
            self._owner[request_id] = index
            self._load[index] += 1
            return index, self.replicas[index]

    def _release(self, request_id: str) -> None:
        with self._lock:
            index = self._owner.pop(request_id, None)
            if index is not None:
                self._load[index] -= 1

    def _attach(self, index: int, replica: Replica) -> None:
        replica.step_observers.append(self._observer(index, replica))
        if isinstance(replica, ProcessEngine):
            replica.on_death = lambda dead, error, i=index: self._on_death(i, dead, error)

    def _observer(self, index: int, replica: Replica) -> StepObserver:
        def observe(outputs: list[RequestOutput], aborted: list[str]) -> None:
            with self._lock:
                current = self.replicas[index] is replica
            if current:  # a replaced replica's last words must not release the new one's ids
                for out in outputs:
                    if out.finished:
                        self._release(out.request_id)
                for request_id in aborted:
                    self._release(request_id)
            for observer in self.step_observers:
                observer(outputs, aborted)

        return observe

    def _on_death(self, index: int, dead: ProcessEngine, error: Exception) -> None:
        """On the dead replica's reader thread, after its requests were failed."""
        if self._stopping:
            return
        logger.warning("data-parallel replica %d died (%s); restarting it", index, error)
        threading.Thread(target=self._restart, args=(index, dead), daemon=True,
                         name=f"rvllm-dp-restart-{index}").start()

    def _restart(self, index: int, dead: ProcessEngine) -> None:
        dead.shutdown(timeout=5.0)
        delay = self.restart_delay
        while not self._stopping:
            try:
                replica = ProcessEngine(dead.args, dead.num_threads)
                with self._lock:
                    self._starting[index] = replica
                replica.wait_ready()
            except Exception:
                with self._lock:
                    self._starting.pop(index, None)
                if self._stopping:
                    return
                logger.exception("data-parallel replica %d failed to start; retrying in "
                                 "%.0fs", index, delay)
                time.sleep(delay)
                delay = min(2 * delay, 30.0)
                continue
            with self._lock:
                del self._starting[index]
                stopping = self._stopping
                if not stopping:
                    final = dead.snapshot()
                    for name in _COUNTERS:
                        self._retired[name] = _plus(self._retired[name],
                                                    getattr(final, name))
                    self._attach(index, replica)
                    self.replicas[index] = replica
            if stopping:
                replica.shutdown(timeout=5.0)
            else:
                logger.info("data-parallel replica %d is back (pid %s)", index, replica.pid)
            return


def _plus(a: Any, b: Any) -> Any:
    """Two replicas' counts summed: numbers, or histogram buckets element by element."""
    if isinstance(a, tuple) or isinstance(b, tuple):
        a, b = (tuple(v) if isinstance(v, tuple) else () for v in (a, b))
        if any(isinstance(x, str) for x in a + b):  # names (LoRA adapters): their union
            return tuple(sorted(set(a) | set(b)))
        n = max(len(a), len(b))
        return tuple(x + y for x, y in zip(a + (0,) * (n - len(a)), b + (0,) * (n - len(b))))
    return a + b
