"""Tensor parallelism's wire: rank 0 runs the engine, ranks 1..N-1 run the same forward
passes (their processes: ``tp_workers``).

Each rank holds its shard of every layer (the layers are tensor-parallel aware)
and its share of the KV heads. Every step, rank 0 broadcasts the flattened
inputs as two int64 tensors (a fixed header, then one packed payload), never a
pickle of Python objects; all ranks run the forward pass, whose collectives
(all-reduce after row-parallel layers, all-gather of the logits) come from
torch.distributed. Sampling happens once, on rank 0.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from rvllm.forward_context import AttentionMetadata, PrefillSeq

logger = logging.getLogger("rvllm")

# num_tokens, num_decodes, decode_max_len, num_prefills, payload_len, stop,
# num_swap_out, num_swap_in
HEADER_LEN = 8
_STOP = 1


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process is gone; the engine cannot take another step."""


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logit_rows: torch.Tensor
    # (device block, CPU block) pairs copied out, then (CPU block, device block) pairs in,
    # before the forward pass (swap preemption); every rank moves its own KV heads.
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(rank: int, world_size: int, init_method: str, device: torch.device,
                     timeout_s: float = 600.0) -> None:
    """Join the process group (NCCL on GPUs, gloo on CPUs) and record this rank's place."""
    from rvllm.distributed import set_tp

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    set_tp(rank, world_size)


def threads_per_rank(world_size: int) -> int:
    """On the CPU each rank gets its own group of cores."""
    return max(1, (os.cpu_count() or 1) // world_size)


# ------------------------------------------------------------------ the step wire


def send_step(step: StepInputs) -> None:
    """Rank 0: broadcast one step's inputs to every other rank."""
    md = step.metadata
    nd = md.num_decode_tokens
    max_len = md.decode_slots.shape[1] if md.decode_slots is not None else 0
    parts = [step.input_ids, step.positions, md.slot_mapping]
    if nd:
        parts += [md.decode_slots.reshape(-1), md.decode_seq_lens]  # type: ignore[union-attr]
    for pairs in (step.swap_out, step.swap_in):
        if pairs:
            parts.append(torch.tensor(pairs, dtype=torch.long).reshape(-1))
    if md.prefills:
        parts.append(torch.tensor([[p.token_start, p.num_tokens, p.context_len]
                                   for p in md.prefills]).reshape(-1))
        parts += [p.slots for p in md.prefills]
    parts.append(step.logit_rows)
    payload = torch.cat([p.to("cpu", torch.long).reshape(-1) for p in parts])
    header = torch.tensor([step.input_ids.numel(), nd, max_len, len(md.prefills),
                           payload.numel(), 0, len(step.swap_out), len(step.swap_in)],
                          dtype=torch.long)
    _broadcast(header)
    _broadcast(payload)


def send_stop() -> None:
    header = torch.zeros(HEADER_LEN, dtype=torch.long)
    header[5] = _STOP
    _broadcast(header)


def recv_step(device: torch.device) -> StepInputs | None:
    """Ranks 1..N-1: the next step's inputs, or None when rank 0 says stop."""
    header = torch.empty(HEADER_LEN, dtype=torch.long)
    _broadcast(header)
    t, nd, max_len, num_prefills, payload_len, stop, n_out, n_in = header.tolist()
    if stop == _STOP:
        return None
    payload = torch.empty(payload_len, dtype=torch.long)
    _broadcast(payload)
    sizes = [t, t, t, nd * max_len, nd, n_out * 2, n_in * 2, num_prefills * 3]
    fixed = sum(sizes)
    input_ids, positions, slot_mapping, dslots, dlens, out_pairs, in_pairs, table = \
        torch.split(payload[:fixed], sizes)
    rest = payload[fixed:]
    prefills = []
    for start, n, ctx in table.view(-1, 3).tolist():
        prefills.append(PrefillSeq(start, n, ctx, rest[: ctx + n].to(device)))
        rest = rest[ctx + n:]
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        num_decode_tokens=nd,
        decode_slots=dslots.view(nd, max_len).to(device) if nd else None,
        decode_seq_lens=dlens.to(device) if nd else None,
        prefills=prefills,
    )
    return StepInputs(input_ids.to(device), positions.to(device), metadata, rest.to(device),
                      [tuple(p) for p in out_pairs.view(-1, 2).tolist()],
                      [tuple(p) for p in in_pairs.view(-1, 2).tolist()])


def _broadcast(t: torch.Tensor) -> None:
    try:
        dist.broadcast(t, src=0)
    except RuntimeError as e:
        raise WorkerDiedError(f"tensor-parallel broadcast failed: {e}") from e
