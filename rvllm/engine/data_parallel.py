"""Data parallelism: N engine replicas behind one server, each request on the least loaded.

Every replica is a whole AsyncEngine (its own model copy, KV cache and step
loop thread; on GPUs, its own device). The step loops run their tensor work
with the GIL released, so replicas compute side by side. The server sees the
same interface as one AsyncEngine: requests are routed to the replica with the
fewest live requests, gauges and counters are summed, and step observers (the
metrics histograms) hear from every replica.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import torch

from rvllm.config import EngineArgs, resolve_device
from rvllm.engine.async_engine import AsyncEngine, EngineSnapshot, RequestStream, StepObserver
from rvllm.engine.llm_engine import PromptType
from rvllm.outputs import RequestOutput
from rvllm.sampling_params import SamplingParams
from rvllm.tokenizer import Tokenizer


class DataParallelEngine:
    """Several AsyncEngine replicas presented as one."""

    def __init__(self, replicas: list[AsyncEngine]) -> None:
        if not replicas:
            raise ValueError("data parallelism needs at least one replica.")
        self.replicas = replicas
        self.step_observers: list[StepObserver] = []
        self._lock = threading.Lock()
        self._owner: dict[str, int] = {}  # live request id -> replica index
        self._load = [0] * len(replicas)
        for index, replica in enumerate(replicas):
            replica.step_observers.append(self._observer(index))

    @classmethod
    def from_engine_args(cls, args: EngineArgs, data_parallel_size: int) -> DataParallelEngine:
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {data_parallel_size}.")
        device = resolve_device(args.device)
        if device.type == "cuda" and data_parallel_size > torch.cuda.device_count():
            raise ValueError(f"data_parallel_size={data_parallel_size} needs as many GPUs; "
                             f"{torch.cuda.device_count()} found.")
        if device.type == "cpu":
            # Each replica's loop thread computes with one share of the cores.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // data_parallel_size))
        replicas = []
        for rank in range(data_parallel_size):
            replica_args = dataclasses.replace(args)
            if device.type == "cuda":
                replica_args.device = f"cuda:{rank}"
            replicas.append(AsyncEngine.from_engine_args(replica_args))
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
    def is_running(self) -> bool:
        return all(r.is_running for r in self.replicas)

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          final_only: bool = False) -> RequestStream:
        with self._lock:
            if request_id in self._owner:
                raise ValueError(f"request id {request_id!r} is already in use.")
            index = min(range(len(self.replicas)), key=self._load.__getitem__)
            self._owner[request_id] = index
            self._load[index] += 1
        try:
            return await self.replicas[index].add_request(request_id, prompt, params, final_only)
        except BaseException:
            self._release(request_id)
            raise

    # The same stream loop as one engine's, over this class's add_request and abort.
    generate = AsyncEngine.generate

    def abort(self, request_id: str) -> None:
        with self._lock:
            index = self._owner.get(request_id)
        if index is not None:
            self.replicas[index].abort(request_id)

    def snapshot(self) -> EngineSnapshot:
        snaps = [r.snapshot() for r in self.replicas]
        total = EngineSnapshot(**{f.name: sum(getattr(s, f.name) for s in snaps)
                                  for f in dataclasses.fields(EngineSnapshot)})
        blocks = max(1, total.num_blocks)
        total.kv_cache_usage = 1.0 - total.num_free_blocks / blocks
        return total

    def shutdown(self, timeout: float = 10.0) -> None:
        for replica in self.replicas:
            replica.shutdown(timeout)

    def replica_loads(self) -> list[int]:
        """Live requests per replica (for tests and logs)."""
        with self._lock:
            return list(self._load)

    # ---------------------------------------------------------------- internals

    def _release(self, request_id: str) -> None:
        with self._lock:
            index = self._owner.pop(request_id, None)
            if index is not None:
                self._load[index] -= 1

    def _observer(self, index: int) -> StepObserver:
        def observe(outputs: list[RequestOutput], aborted: list[str]) -> None:
            for out in outputs:
                if out.finished:
                    self._release(out.request_id)
            for request_id in aborted:
                self._release(request_id)
            for observer in self.step_observers:
                observer(outputs, aborted)

        return observe
