"""Tensor parallelism's worker processes: ranks 1..N-1, each loading its shard and
running every forward pass rank 0 broadcasts (``parallel``), and rank 0's handle on
them (the ``mp`` backend; ``ray_executor`` starts the same ``worker_main`` as Ray
actors)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from rvllm.executor.parallel import (
    WorkerDiedError,
    free_port,
    init_distributed,
    recv_step,
    send_stop,
    threads_per_rank,
)


def worker_main(rank: int, world_size: int, init_method: str, engine_args: Any,
                num_blocks: int) -> None:
    """Entry point of ranks 1..N-1 (a spawned process)."""
    from rvllm.config import (
        ModelConfig,
        resolve_device,
        resolve_dtype,
        resolve_kv_cache_dtype,
    )
    from rvllm.executor.model_runner import ModelRunner
    from rvllm.forward_context import (
        add_block_tables,
        decode_block_tables,
        set_forward_context,
    )
    from rvllm.layers.backend import resolve_kernel_backend, set_kernel_backend, use_triton
    from rvllm.models.loader import load_model

    device = resolve_device(engine_args.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    torch.set_num_threads(threads_per_rank(world_size))
    init_distributed(rank, world_size, init_method, device)
    dtype = resolve_dtype(engine_args.dtype, device)
    kv_dtype = resolve_kv_cache_dtype(engine_args.kv_cache_dtype, dtype, device)
    backend = resolve_kernel_backend(engine_args.kernel_backend, device, dtype)
    if backend == "numba":
        from rvllm.kernels.cpu import warm_up_numba

        warm_up_numba(kv_dtype, engine_args.quantization == "int8")  # packed: one rank only
    set_kernel_backend(backend)
    config = ModelConfig.from_path(engine_args.resolve_model(), dtype, engine_args.max_model_len)
    model = load_model(config, device, load_format=engine_args.load_format,
                       cpu_linear_backend=engine_args.cpu_linear_backend,
                       quantization=None if engine_args.quantization in (None, "none")
                       else engine_args.quantization)
    runner = ModelRunner(model, engine_args.block_size, device)
    runner.allocate_kv_cache(num_blocks, config.num_kv_heads, config.head_dim, kv_dtype)
    if engine_args.num_cpu_blocks and engine_args.preemption_mode != "recompute":
        runner.allocate_swap_space(engine_args.num_cpu_blocks)
    dist.barrier()
    with torch.inference_mode():
        while (step := recv_step(device)) is not None:
            if step.swap_out or step.swap_in:
                runner.swap(step.swap_out, step.swap_in)
            md = step.metadata
            if use_triton():
                add_block_tables(md, engine_args.block_size)
            elif md.num_decode_tokens:
                md.decode_block_tables = decode_block_tables(md, engine_args.block_size)
            with set_forward_context(md):
                hidden = model(step.input_ids, step.positions)
                if step.logit_rows.numel():
                    model.compute_logits(hidden[step.logit_rows])
    dist.destroy_process_group()


class TensorParallelGroup:
    """Rank 0's handle on its worker processes (the ``mp`` backend)."""

    def __init__(self, engine_args: Any, world_size: int, num_blocks: int,
                 device: torch.device) -> None:
        import torch.multiprocessing as mp

        self.world_size = world_size
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")
        self.procs = [
            ctx.Process(target=worker_main, daemon=True, name=f"rvllm-tp{rank}",
                        args=(rank, world_size, init_method, engine_args, num_blocks))
            for rank in range(1, world_size)
        ]
        for p in self.procs:
            p.start()
        torch.set_num_threads(threads_per_rank(world_size))
        init_distributed(0, world_size, init_method, device)
        self.stopped = False

    def wait_ready(self) -> None:
        """Returns once every rank has loaded its shard and allocated its cache."""
        dist.barrier()

    def check_alive(self, grace: float = 0.0) -> None:
        """Raises WorkerDiedError if a worker is gone, waiting up to ``grace`` seconds for
        one to be: a killed worker's sockets break a moment before its exit is reported,
        and under load that moment can outlast the collective that saw them break."""
        deadline = time.monotonic() + grace
        while True:
            dead = [p.name for p in self.procs if not p.is_alive()]
            if dead:
                raise WorkerDiedError(f"tensor-parallel worker(s) {', '.join(dead)} died.")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.02)

    def shutdown(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        try:
            if all(p.is_alive() for p in self.procs):
                send_stop()
        except WorkerDiedError:
            pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
        if dist.is_initialized():
            dist.destroy_process_group()
        from rvllm.distributed import set_tp

        set_tp(0, 1)
