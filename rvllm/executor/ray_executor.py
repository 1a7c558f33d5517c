"""The ``ray`` backend: tensor-parallel workers placed by a Ray placement group.

Ray only places and supervises the worker processes; the tensors still move
over torch.distributed, exactly as with the ``mp`` backend. Run ``ray start
--head`` on one machine and ``ray start --address HEAD:6379`` on the others,
then start rvllm on the head with ``--distributed-executor-backend ray``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from rvllm.executor.parallel import (
    WorkerDiedError,
    free_port,
    init_distributed,
    send_stop,
    threads_per_rank,
)
from rvllm.executor.tp_workers import worker_main


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ValueError(
            "the ray backend needs Ray: pip install 'ray>=2.9' (or use "
            "--distributed-executor-backend mp)"
        ) from e
    return ray


class _Worker:
    """A Ray actor hosting one tensor-parallel rank."""

    def run(self, rank: int, world_size: int, init_method: str, engine_args: Any,
            num_blocks: int) -> None:
        worker_main(rank, world_size, init_method, engine_args, num_blocks)


class RayTensorParallelGroup:
    """Rank 0's handle on workers that Ray placed, on this machine or others."""

    def __init__(self, engine_args: Any, world_size: int, num_blocks: int,
                 device: torch.device) -> None:
        ray = _ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            address = os.environ.get("RAY_ADDRESS")
            kwargs: dict[str, Any] = {}
            if address is None:
                # A private local instance: keep it on loopback.
                kwargs["_node_ip_address"] = "127.0.0.1"
            ray.init(address=address, include_dashboard=False, log_to_driver=False, **kwargs)
        resource = "GPU" if device.type == "cuda" else "CPU"
        per_rank = 1 if resource == "GPU" else threads_per_rank(world_size)
        self.pg = placement_group([{resource: per_rank}] * (world_size - 1))
        ray.get(self.pg.ready(), timeout=120)
        host = ray.util.get_node_ip_address()
        init_method = f"tcp://{host}:{free_port()}"
        actor = ray.remote(_Worker)
        self.workers = [
            actor.options(
                num_cpus=per_rank if resource == "CPU" else 0,
                num_gpus=1 if resource == "GPU" else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=i),
            ).remote()
            for i in range(world_size - 1)
        ]
        self.runs = [
            w.run.remote(rank, world_size, init_method, engine_args, num_blocks)
            for rank, w in enumerate(self.workers, start=1)
        ]
        torch.set_num_threads(threads_per_rank(world_size))
        init_distributed(0, world_size, init_method, device)
        self.stopped = False

    def wait_ready(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def check_alive(self, grace: float = 0.0) -> None:
        ray = _ray()
        if ray.wait(self.runs, num_returns=1, timeout=grace)[0]:  # the first to end
            done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
            raise WorkerDiedError(f"{len(done)} Ray tensor-parallel worker(s) died.")

    def kill_worker(self, index: int) -> None:
        """Kill one worker (used to test fault handling)."""
        _ray().kill(self.workers[index], no_restart=True)

    def shutdown(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        ray = _ray()
        import torch.distributed as dist

        try:
            self.check_alive()
            send_stop()
            ray.get(self.runs, timeout=10)
        except Exception:  # noqa: BLE001 - a worker already gone is what we clean up after
            for w in self.workers:
                ray.kill(w, no_restart=True)
        ray.util.remove_placement_group(self.pg)
        if dist.is_initialized():
            dist.destroy_process_group()
        from rvllm.distributed import set_tp

        set_tp(0, 1)
        if self._started_ray:
            ray.shutdown()
