"""Turns one scheduled step into tensors, runs the model once, and samples."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from rvllm.engine.scheduler import ScheduledSeq, SchedulerOutput
from rvllm.engine.sequence import Sequence
from rvllm.executor.device_tokens import DeviceTokens, fill_placeholders, host_tokens
from rvllm.executor.kv_cache import empty_cpu_cache
from rvllm.forward_context import (
    AttentionMetadata,
    PrefillSeq,
    add_block_tables,
    decode_slots_from_tables,
    set_forward_context,
    upload,
)
from rvllm.host_memory import populate
from rvllm.layers.backend import use_numba, use_triton
from rvllm.layers.sampler import (
    Sampler,
    SamplingRow,
    compute_prompt_logprobs,
    plain_greedy,
    top_logprobs,
    verify_drafts,
)
from rvllm.lora.layers import lora_rows
from rvllm.spec_decode.rejection import verify_greedy

if TYPE_CHECKING:
    from rvllm.kernels.cpu.decoder_step import DecodeLogits


@dataclass(slots=True)
class SeqStepOutput:
    """What one step produced for one sequence."""

    seq: Sequence
    num_new_tokens: int
    token_id: int | None = None
    logprob: float = 0.0
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None
    # (logprob of each actual next prompt token, top ids, top logprobs) for this chunk
    prompt_logprobs: tuple[list[float], list[list[int]], list[list[float]]] | None = None
    prompt_next_ids: list[int] | None = None
    # The tokens (and logprobs) of the decode steps after the first, when one step ran
    # several (``SchedulerOutput.num_steps``): the engine appends them in turn.
    later_tokens: tuple[tuple[int, float], ...] = ()
    # With top logprobs asked: each later token's top ids and logprobs.
    later_tops: tuple[tuple[list[int], list[float]], ...] = ()
    # Speculative decoding: the drafts this step verified, and how many it kept.
    num_drafts: int = 0
    num_accepted: int = 0
    # Overlapped steps: the token and logprob are row ``pending_row`` of these, still on
    # the device until ``device_tokens.resolve_outputs`` fills them in.
    pending: DeviceTokens | None = None
    pending_row: int = 0
    # A pooling sequence's chunk: the hidden states of the positions it pools (from
    # ``pool_first``, ``pool_count`` of them, in float32), and whether it ended the prompt.
    pool_rows: torch.Tensor | None = None
    pool_count: int = 0
    pool_first: int = 0
    pool_done: bool = False


def bind_fp8_kv_scales(layers: list[nn.Module], device: torch.device) -> None:
    """Give each layer of an FP8 KV cache fresh key and value scales, to be set by its
    first step with prefill tokens (``kernels.triton.kv_fp8``); refuse layers the Triton
    kernels that read it do not cover: multi-head latent attention, soft-capped logits."""
    from rvllm.kernels.triton.kv_fp8 import new_kv_scale
    from rvllm.layers.attention import Attention

    for attn in layers:
        if type(attn).forward is not Attention.forward or attn.logits_soft_cap is not None:
            raise ValueError(f"the fp8 KV cache covers plain attention only, not this model's "
                             f"({type(attn).__name__}, soft cap {attn.logits_soft_cap}); use "
                             "--kv-cache-dtype auto.")
        attn.kv_scale = new_kv_scale(device)
        attn.kv_scale_pending = True


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A float8 cache tensor as uint8 (index_copy_ has no float8 kernels), else itself."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


class ModelRunner:
    def __init__(self, model: nn.Module, block_size: int, device: torch.device) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.tp_group = None  # rank 0's TensorParallelGroup when tensor_parallel_size > 1
        self.decode_graphs = None  # DecodeGraphs when decode runs as CUDA graphs
        self.lora_enabled = False  # --enable-lora: steps may have adapters to look for
        self.swap_space: list[tuple[torch.Tensor, ...]] = []

    def allocate_kv_cache(self, num_blocks: int, num_kv_heads: int, head_dim: int,
                          dtype: torch.dtype) -> None:
        # Left uninitialised (fast to allocate): attention only ever gathers slots that
        # were written, since padding in the decode gather repeats a real slot.
        layers = self.model.attention_layers()
        if dtype == torch.float8_e4m3fn:
            bind_fp8_kv_scales(layers, self.device)
        shapes = {(getattr(a, "num_kv_heads", num_kv_heads), getattr(a, "head_dim", head_dim))
                  for a in layers if getattr(a, "cache_entry_shapes", None) is None}
        if len(shapes) == 1 and all(getattr(a, "cache_entry_shapes", None) is None
                                    for a in layers):
            # Every layer alike: one allocation for all keys and one for all values, each
            # layer a slice, so a whole-stack kernel (kernels.cpu.decoder_step) can
            # take the caches as one array.
            shape = (len(layers), num_blocks, self.block_size, *shapes.pop())
            keys, values = self._cache_tensor(shape, dtype), self._cache_tensor(shape, dtype)
            for i, attn in enumerate(layers):
                attn.kv_cache = (keys[i], values[i])
            return
        for attn in layers:
            # A layer may ask for its own per-token entries (MLA caches one latent).
            entries = getattr(attn, "cache_entry_shapes", None)
            if entries is not None:
                attn.kv_cache = tuple(
                    self._cache_tensor((num_blocks, self.block_size, *entry), dtype)
                    for entry in entries
                )
                continue
            # This rank's share of the KV heads (all of them without tensor parallelism).
            local = (num_blocks, self.block_size,
                     getattr(attn, "num_kv_heads", num_kv_heads),
                     getattr(attn, "head_dim", head_dim))
            attn.kv_cache = (self._cache_tensor(local, dtype), self._cache_tensor(local, dtype))

    def kv_cache_block_bytes(self) -> int:
        """The bytes of one block id across every layer's cache tensors."""
        return sum(t[0].nbytes for attn in self.model.attention_layers()
                   for t in attn.kv_cache or ())

    def populate_kv_cache(self, first: int, count: int) -> bool:
        """Fault in the CPU memory of cache blocks [first, first + count) of every layer,
        their contents unchanged (``host_memory.populate``): a block's first write
        otherwise pays for its pages inside a decode step. Whether it could (a CPU cache,
        on Linux 5.14 or later)."""
        if self.device.type != "cpu":
            return False
        done = True
        for attn in self.model.attention_layers():
            for t in attn.kv_cache or ():
                row = t[0].nbytes
                done &= populate(t.data_ptr() + first * row, count * row)
        return done

    def _cache_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Uninitialised cache memory (on the CPU: ``empty_cpu_cache``)."""
        if self.device.type == "cpu":
            return empty_cpu_cache(shape, dtype)
        return torch.empty(shape, dtype=dtype, device=self.device)

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_seqs: int, max_model_len: int,
                    num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        """One forward pass at the largest step the scheduler can make (``num_tokens``
        prompt tokens in sequences of at most ``max_model_len``, logits for ``num_seqs``
        rows) over a throwaway cache, so the activations' peak memory can be measured."""
        bs = self.block_size
        lens = [max_model_len] * (num_tokens // max_model_len)
        if num_tokens % max_model_len:
            lens.append(num_tokens % max_model_len)
        num_blocks = sum(-(-n // bs) for n in lens)
        self.allocate_kv_cache(num_blocks, num_kv_heads, head_dim, dtype)
        prefills, slots, positions, start, block = [], [], [], 0, 0
        for n in lens:
            seq_slots = torch.arange(n, device=self.device) + block * bs
            prefills.append(PrefillSeq(start, n, 0, seq_slots))
            slots.append(seq_slots)
            positions.append(torch.arange(n, device=self.device))
            start, block = start + n, block + -(-n // bs)
        metadata = AttentionMetadata(torch.cat(slots), 0, None, None, prefills)
        if use_triton():
            add_block_tables(metadata, bs)
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        try:
            with set_forward_context(metadata):
                hidden = self.model(input_ids, torch.cat(positions))
                self.model.compute_logits(hidden[-min(num_seqs, num_tokens):])
        finally:
            for attn in self.model.attention_layers():
                attn.kv_cache = None

    def allocate_swap_space(self, num_cpu_blocks: int) -> None:
        """A CPU copy of each layer's cache layout, for swap preemption."""
        pin = self.device.type == "cuda"
        self.swap_space = [
            tuple(torch.empty((num_cpu_blocks, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)
                  for t in attn.kv_cache)
            for attn in self.model.attention_layers()
        ]

    def swap(self, blocks_to_swap_out: list[tuple[int, int]],
             blocks_to_swap_in: list[tuple[int, int]]) -> None:
        """Copy preempted blocks out before any reuse, then resumed ones back in."""
        if blocks_to_swap_out:
            dev = torch.tensor([d for d, _ in blocks_to_swap_out], device=self.device)
            cpu = torch.tensor([c for _, c in blocks_to_swap_out])
            for attn, host in zip(self.model.attention_layers(), self.swap_space):
                for src, dst in zip(attn.kv_cache, host):
                    _bytes(dst).index_copy_(0, cpu, _bytes(src).index_select(0, dev).cpu())
        if blocks_to_swap_in:
            cpu = torch.tensor([c for c, _ in blocks_to_swap_in])
            dev = torch.tensor([d for _, d in blocks_to_swap_in], device=self.device)
            for attn, host in zip(self.model.attention_layers(), self.swap_space):
                for src, dst in zip(host, attn.kv_cache):
                    moved = _bytes(src).index_select(0, cpu).to(self.device)
                    _bytes(dst).index_copy_(0, dev, moved)

    def execute(self, sched: SchedulerOutput, feed: DeviceTokens | None = None,
                defer: bool = False) -> list[SeqStepOutput]:
        """Run one scheduled step and sample it. A step that the CPU's compiled decode
        covers (``_compiled_step``) runs outside torch's inference mode: it makes no
        tensors, and entering and leaving the mode cost about 15 us of a one-row step,
        on code that the step's weights had pushed out of the caches.

        Overlapped steps (``engine.async_steps``): ``feed`` holds the tokens of the step
        before, still on the device, which the sequences' placeholders stand for; ``defer``
        lets this step leave its own there (``device_tokens``). Both apply to a decode
        graph's step whose rows are all plain greedy; any other step takes the tokens to
        the host first and samples as usual."""
        if sched.blocks_to_swap_out or sched.blocks_to_swap_in:
            with torch.inference_mode():
                self.swap(sched.blocks_to_swap_out, sched.blocks_to_swap_in)
        decodes = [s for s in sched.scheduled if s.num_new_tokens == 1]
        prefills = [s for s in sched.scheduled if s.num_new_tokens > 1]
        ordered = decodes + prefills
        plan = _plan_logits(ordered)
        # LoRA adapters are added in the linear layers' forward, which the compiled CPU
        # calls and the CUDA graphs do not run: a step with one runs through the layers.
        lora = self.lora_enabled and any(s.seq.lora_id for s in ordered)
        # Decodes alone, each sampling its one row: the step a graph or compiled call takes.
        decode_only = bool(decodes and not prefills and self.tp_group is None
                           and not plan.prompt and not plan.pool and not lora
                           and plan.rows == list(range(len(decodes))))
        # Only overlapped steps ask (``feed``/``defer``): plain steps skip the row checks.
        on_device = ((feed is not None or defer) and decode_only
                     and self.decode_graphs is not None
                     and len(decodes) <= self.decode_graphs.max_batch and use_triton()
                     and all(plain_greedy(s.seq.params, s.seq.num_output_tokens)
                             for s in decodes))
        if feed is not None and not on_device:
            fill_placeholders(sched.scheduled, host_tokens(feed))
            feed = None
        if decode_only and self.decode_graphs is None and use_numba():
            outputs = self._compiled_step(decodes, plan, sched.num_steps)
            if outputs is not None:
                return outputs
        if (prefills and self.decode_graphs is None and self.tp_group is None and use_numba()
                and not plan.prompt and not plan.pool and not lora
                and all(_verifies(s) for s in prefills)):
            outputs = self._compiled_verify_step(ordered, plan)
            if outputs is not None:
                return outputs
        return self._execute(sched, decodes, prefills, plan, decode_only, feed,
                             defer and on_device)

    def _compiled_verify_step(self, ordered: list[ScheduledSeq], plan: _LogitsPlan
                              ) -> list[SeqStepOutput] | None:
        """Decodes and speculating sequences (their last token and drafts) in one compiled
        CPU decode call: each token is a row at its own position over the sequence's
        block table. The call writes every row's K/V before any row attends, so the
        rows of one sequence attend causally, as a prefill's would. None where the call
        does not cover the step."""
        decode_logits = getattr(self.model, "decode_logits", None)
        if decode_logits is None:
            return None
        bs = self.block_size
        rows = [(s.seq, s.seq.num_computed_tokens + j) for s in ordered
                for j in range(s.num_new_tokens)]
        count = len(rows)
        ids, pos, slots = (np.empty(count, np.int64) for _ in range(3))
        width = max(p for _, p in rows) // bs + 1
        tables = np.zeros((count, width), np.int64)
        for i, (seq, p) in enumerate(rows):
            table = seq.block_table
            ids[i], pos[i], slots[i] = seq.token_ids[p], p, table[p // bs] * bs + p % bs
            used = table[:width]
            tables[i, :len(used)] = used
        # Greedy rows alone: the call finds each row's argmax and its logprob, and the
        # drafts are checked against those, no logits read back.
        greedy = all(plain_greedy(s.seq.params, s.seq.num_output_tokens) for s in ordered)
        compiled = decode_logits(ids, pos, slots, tables, greedy)
        if compiled is None:
            return None
        if compiled.greedy is not None:
            found, logprobs = compiled.greedy
            return self._sample(ordered, plan, None, ([found[r] for r in plan.rows],
                                                      [logprobs[r] for r in plan.rows]))
        with torch.inference_mode():
            logits = compiled.logits[torch.tensor(plan.rows, dtype=torch.long)]
            return self._sample(ordered, plan, logits)

    def _compiled_step(self, decodes: list[ScheduledSeq], plan: _LogitsPlan, num_steps: int
                       ) -> list[SeqStepOutput] | None:
        """A step of decodes alone, each sampling its one row, as one compiled CPU call
        (or ``num_steps`` of them); None where that does not cover the step."""
        if num_steps > 1:
            outputs = self._run_compiled_steps(decodes, num_steps)
            if outputs is not None:
                return outputs
        compiled = self._run_compiled_decode(decodes)
        if compiled is None:
            return None
        if compiled.greedy is not None:
            return self._sample(decodes, plan, None, compiled.greedy)
        with torch.inference_mode():
            return self._sample(decodes, plan, compiled.logits)

    @torch.inference_mode()
    def _execute(self, sched: SchedulerOutput, decodes: list[ScheduledSeq],
                 prefills: list[ScheduledSeq], plan: _LogitsPlan, decode_only: bool,
                 feed: DeviceTokens | None = None, defer: bool = False
                 ) -> list[SeqStepOutput]:
        """The step through the model's layers (or a CUDA graph), ``execute``'s split of
        the scheduled sequences given."""
        ordered = decodes + prefills
        graphs = self.decode_graphs
        if decode_only and graphs is not None and len(decodes) <= graphs.max_batch:
            logits = self._run_decode_graph(decodes, feed)
            if defer:
                return self._greedy_on_device(decodes, logits.float())
            return self._sample(ordered, plan, logits.float())
        input_ids, positions, metadata = self._prepare(decodes, prefills)
        logit_rows = upload(torch.tensor(plan.rows, dtype=torch.long), self.device)
        if self.tp_group is not None:
            from rvllm.executor.parallel import StepInputs, send_step

            send_step(StepInputs(input_ids, positions, metadata, logit_rows,
                                 sched.blocks_to_swap_out, sched.blocks_to_swap_in))
        rows = _lora_rows(ordered, self.device) if self.lora_enabled else None
        with set_forward_context(metadata), lora_rows(rows):
            hidden = self.model(input_ids, positions)
            # One LM-head call for every row that needs logits (all ranks join it).
            logits = self.model.compute_logits(hidden[logit_rows]).float() if plan.rows else None
        outputs = self._sample(ordered, plan, logits)
        for i, (row, count, first, done) in plan.pool.items():
            out = outputs[i]
            if count:
                out.pool_rows = hidden[row:row + count].float()
            out.pool_count, out.pool_first, out.pool_done = count, first, done
        return outputs

    def _prepare(self, decodes: list[ScheduledSeq], prefills: list[ScheduledSeq]
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        ids, pos, slots = self._decode_inputs(decodes)
        prefill_meta = [add_chunk(s.seq, s.seq.num_computed_tokens, s.num_new_tokens, bs,
                                  self.device, ids, pos, slots) for s in prefills]
        dev = self.device
        # The numba kernels read the block tables: the per-position slots are built only
        # if a torch path asks (AttentionMetadata.gather_slots). Tensor parallelism sends
        # them to the workers.
        lazy = use_numba() and self.tp_group is None
        decode_slots, decode_seq_lens, decode_tables = self._decode_gather(decodes, lazy)
        metadata = AttentionMetadata(
            slot_mapping=upload(torch.tensor(slots, dtype=torch.long), dev),
            num_decode_tokens=len(decodes),
            decode_slots=decode_slots,
            decode_seq_lens=decode_seq_lens,
            prefills=prefill_meta,
            decode_block_tables=decode_tables,
            block_size=bs,
        )
        if use_triton():
            add_block_tables(metadata, bs)
        return (upload(torch.tensor(ids, dtype=torch.long), dev),
                upload(torch.tensor(pos, dtype=torch.long), dev), metadata)

    def _decode_inputs(self, decodes: list[ScheduledSeq]
                       ) -> tuple[list[int], list[int], list[int]]:
        """Token, position and cache slot of each decode's new token."""
        bs = self.block_size
        ids, pos, slots = [], [], []
        for s in decodes:
            seq = s.seq
            p = seq.num_computed_tokens
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
        return ids, pos, slots

    def _run_decode_graph(self, decodes: list[ScheduledSeq],
                          feed: DeviceTokens | None = None) -> torch.Tensor:
        """Logits of a decode-only step, replayed from the captured CUDA graphs; the
        inputs still placeholders are ``feed``'s tokens, read on the device."""
        bs = self.block_size
        lens = [s.seq.num_computed_tokens + 1 for s in decodes]
        tables = [s.seq.block_table[: (n - 1) // bs + 1] for s, n in zip(decodes, lens)]
        fed = None if feed is None else (feed.token_ids, feed.sources(decodes))
        return self.decode_graphs.run(*self._decode_inputs(decodes), lens, tables, fed)

    def _greedy_on_device(self, decodes: list[ScheduledSeq], logits: torch.Tensor
                          ) -> list[SeqStepOutput]:
        """Each row's argmax and its logprob (the sampler's greedy kernel), left on the
        device: the outputs' tokens come with ``device_tokens.resolve_outputs``."""
        from rvllm.kernels.triton.greedy import greedy_sample

        token_ids, logprobs = greedy_sample(logits)
        pending = DeviceTokens(token_ids, logprobs, [s.seq.seq_id for s in decodes])
        return [SeqStepOutput(s.seq, 1, pending=pending, pending_row=i)
                for i, s in enumerate(decodes)]

    def _run_compiled_decode(self, decodes: list[ScheduledSeq]) -> DecodeLogits | None:
        """A decode-only step on the CPU as the model's compiled call from token ids to
        logits (``CausalLM.decode_logits``), its inputs made as numpy arrays straight from
        the sequences: no tensors, no forward context, no per-layer Python. When every row
        is ``plain_greedy`` the call finds their tokens too, and the sampler is skipped.
        None where the model does not offer it for this step."""
        decode_logits = getattr(self.model, "decode_logits", None)
        if decode_logits is None:
            return None
        ids, pos, slots, tables = self._decode_arrays(decodes, 1)
        greedy = all(plain_greedy(s.seq.params, s.seq.num_output_tokens) for s in decodes)
        return decode_logits(ids, pos, slots, tables, greedy)

    def _run_compiled_steps(self, decodes: list[ScheduledSeq], num_steps: int
                            ) -> list[SeqStepOutput] | None:
        """Up to ``num_steps`` decode steps in one compiled CPU call, each step's tokens
        the next one's input (``CausalLM.decode_greedy_steps``), when every sequence is
        ``plain_greedy``: each output has the first step's token, and ``later_tokens``
        the rest. The call stops early once every sequence has made one of its stop
        tokens. None where that does not cover the step."""
        greedy_steps = getattr(self.model, "decode_greedy_steps", None)
        if greedy_steps is None or not all(
                plain_greedy(s.seq.params, s.seq.num_output_tokens) for s in decodes):
            return None
        ids, pos, _, tables = self._decode_arrays(decodes, num_steps)
        stop_sets = [s.seq.params.eos_token_ids.union(s.seq.params.stop_token_ids)
                     for s in decodes]
        stops = np.full((len(decodes), max(1, *map(len, stop_sets))), -1, np.int64)
        for row, tokens in zip(stops, stop_sets):
            row[:len(tokens)] = sorted(tokens)
        found = greedy_steps(ids, pos, tables, self.block_size, num_steps, stops)
        if found is None:
            return None
        tokens, logprobs = found
        outputs = []
        for i, s in enumerate(decodes):
            out = SeqStepOutput(s.seq, 1, tokens[0][i], logprobs[0][i])
            out.later_tokens = tuple((t[i], lp[i]) for t, lp in zip(tokens[1:], logprobs[1:]))
            outputs.append(out)
        return outputs

    def _decode_arrays(self, decodes: list[ScheduledSeq], num_steps: int
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The compiled decode's inputs, straight from the sequences: each one's token,
        position and cache slot (int64 [B]), and its block table (int64 [B, W], padded
        with block 0) as far as the position of the last of ``num_steps`` steps."""
        bs, rows = self.block_size, len(decodes)
        ids, pos, slots = (np.empty(rows, np.int64) for _ in range(3))
        width = (max(s.seq.num_computed_tokens for s in decodes) + num_steps - 1) // bs + 1
        tables = np.zeros((rows, width), np.int64)
        for i, s in enumerate(decodes):
            seq = s.seq
            p, table = seq.num_computed_tokens, seq.block_table
            ids[i], pos[i], slots[i] = seq.token_ids[p], p, table[p // bs] * bs + p % bs
            used = table[:width]
            tables[i, :len(used)] = used
        return ids, pos, slots, tables

    def _decode_gather(self, decodes: list[ScheduledSeq], lazy_slots: bool = False
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Cache slots of every context position of each decoding sequence (padded; None
        with ``lazy_slots``), the sequences' lengths, and their block tables (padded with
        block 0)."""
        if not decodes:
            return None, None, None
        bs = self.block_size
        lens = [s.seq.num_computed_tokens + 1 for s in decodes]
        max_blocks = -(-max(lens) // bs)
        rows = [s.seq.block_table[:max_blocks] for s in decodes]
        tables = torch.tensor([row + [0] * (max_blocks - len(row)) for row in rows],
                              dtype=torch.long)
        seq_lens = torch.tensor(lens)
        slots = None if lazy_slots else decode_slots_from_tables(tables, seq_lens, bs)
        dev = self.device
        return (None if slots is None else upload(slots, dev), upload(seq_lens, dev),
                upload(tables, dev))

    def _sample(self, ordered: list[ScheduledSeq], plan: _LogitsPlan,
                logits: torch.Tensor | None,
                greedy: tuple[list[int], list[float]] | None = None) -> list[SeqStepOutput]:
        """Each sequence's output of the step from its logits rows; ``greedy``: every
        sequence is ``plain_greedy``, and these are the argmax tokens and their logprobs
        of ``plan.rows`` (the compiled decode found them): a sampling row's is its sample,
        and a speculating sequence's drafts are kept while they equal them."""
        outputs = [SeqStepOutput(s.seq, s.num_new_tokens) for s in ordered]
        if greedy is not None:
            found, logprobs = greedy
            for i, (first, count) in plan.spec.items():
                draft = outputs[i].seq.spec_tokens[:count - 1]
                tokens = verify_greedy(found[first:first + count], draft)
                _commit_verified(outputs[i], draft, tokens, logprobs[first:first + len(tokens)])
            for j, i in enumerate(plan.sampling):
                row = plan.sample_offset + j
                outputs[i].token_id, outputs[i].logprob = found[row], logprobs[row]
            return outputs
        for i, (first, count, next_ids) in plan.prompt.items():
            out = outputs[i]
            k = out.seq.params.prompt_logprobs or 0
            assert logits is not None
            out.prompt_logprobs = compute_prompt_logprobs(
                logits[first:first + count], torch.tensor(next_ids, device=logits.device), k
            )
            out.prompt_next_ids = next_ids
        for i, (first, count) in plan.spec.items():
            out = outputs[i]
            seq = out.seq
            assert logits is not None
            draft = seq.spec_tokens[:count - 1]
            tokens, logprobs = verify_drafts(logits[first:first + count], draft, seq.params,
                                             seq.generator, seq.grammar)
            _commit_verified(out, draft, tokens, logprobs)
            if seq.params.logprobs is not None:
                ids, tops = top_logprobs(logits[first:first + len(tokens)], seq.params.logprobs)
                out.top_ids, out.top_logprobs = ids[0], tops[0]
                out.later_tops = tuple(zip(ids[1:], tops[1:]))
        if plan.sampling:
            assert logits is not None
            sampling = [outputs[i] for i in plan.sampling]
            rows = [
                SamplingRow(o.seq.params, o.seq.prompt_token_ids, o.seq.output_token_ids,
                            o.seq.generator, o.seq.grammar)
                for o in sampling
            ]
            result = self.sampler(logits[plan.sample_offset:], rows)
            for j, o in enumerate(sampling):
                o.token_id = result.sampled_token_ids[j]
                o.logprob = result.sampled_logprobs[j]
                if result.top_logprob_ids is not None:
                    o.top_ids = result.top_logprob_ids[j]
                    o.top_logprobs = result.top_logprobs[j]
        return outputs


def add_chunk(seq: Sequence, ctx: int, n: int, block_size: int, device: torch.device,
              ids: list[int], pos: list[int], slots: list[int]) -> PrefillSeq:
    """Positions [ctx, ctx + n) of ``seq`` as a chunk that attends over the ``ctx`` before
    it in the cache: their tokens, positions and slots appended to the step's lists, and
    the chunk's ``PrefillSeq``."""
    table = torch.tensor(seq.block_table, dtype=torch.long)
    all_pos = torch.arange(ctx + n)
    seq_slots = table[all_pos // block_size] * block_size + all_pos % block_size
    chunk = PrefillSeq(len(ids), n, ctx, upload(seq_slots, device))
    ids.extend(seq.token_ids[ctx:ctx + n])
    pos.extend(range(ctx, ctx + n))
    slots.extend(seq_slots[ctx:].tolist())
    return chunk


def _commit_verified(out: SeqStepOutput, draft: list[int], tokens: list[int],
                     logprobs: list[float]) -> None:
    """A speculating sequence's output from its verified ``tokens`` (the drafts kept, then
    the target's own) and their logprobs. The kept drafts' positions count as computed,
    one at a time, as the engine appends each token (``later_tokens``), like a
    multi-step decode."""
    out.num_new_tokens = 1
    out.token_id, out.logprob = tokens[0], logprobs[0]
    out.later_tokens = tuple(zip(tokens[1:], logprobs[1:]))
    kept = next((i for i, (t, d) in enumerate(zip(tokens, draft)) if t != d),
                min(len(tokens), len(draft)))
    out.num_drafts, out.num_accepted = len(draft), kept


def _verifies(s: ScheduledSeq) -> bool:
    """A speculating sequence scheduled with its last token and drafts, nothing else."""
    seq = s.seq
    return bool(seq.spec_tokens) and s.samples and s.num_new_tokens == len(seq.spec_tokens) + 1


@dataclass(slots=True)
class _LogitsPlan:
    """Which hidden rows need logits: prompt-logprob rows first, then one row per
    sampling sequence (its last token)."""

    rows: list[int] = field(default_factory=list)
    # index in `ordered` -> (first logits row, row count, actual next prompt tokens)
    prompt: dict[int, tuple[int, int, list[int]]] = field(default_factory=dict)
    sampling: list[int] = field(default_factory=list)  # indices in `ordered`
    sample_offset: int = 0
    # index in `ordered` -> (first logits row, row count): a speculating sequence's rows,
    # its last committed token's and each draft's
    spec: dict[int, tuple[int, int]] = field(default_factory=dict)
    # index in `ordered` -> (first hidden row, row count, first position, the chunk ends
    # the prompt): a pooling sequence's rows to pool, no logits
    pool: dict[int, tuple[int, int, int, bool]] = field(default_factory=dict)


def _plan_logits(ordered: list[ScheduledSeq]) -> _LogitsPlan:
    plan = _LogitsPlan()
    sample_rows: list[int] = []
    start = 0
    for i, s in enumerate(ordered):
        seq, n = s.seq, s.num_new_tokens
        if seq.wants_prompt_logprobs:
            # Position p predicts prompt token p + 1; after a preemption the
            # positions already collected are skipped.
            ctx = seq.num_computed_tokens
            first = max(ctx, len(seq.prompt_logprobs) - 1)  # type: ignore[arg-type]
            last = min(ctx + n, seq.num_prompt_tokens - 1)
            if last > first:
                plan.prompt[i] = (len(plan.rows), last - first,
                                  seq.token_ids[first + 1:last + 1])
                plan.rows.extend(range(start + first - ctx, start + last - ctx))
        if seq.pooling is not None:
            plan.pool[i] = _pool_rows(seq, start, n)
        elif seq.spec_tokens and s.samples:
            plan.spec[i] = (len(plan.rows), n)
            plan.rows.extend(range(start, start + n))
        elif s.samples:
            sample_rows.append(start + n - 1)
            plan.sampling.append(i)
        start += n
    plan.sample_offset = len(plan.rows)
    plan.rows.extend(sample_rows)
    return plan


def _lora_rows(ordered: list[ScheduledSeq], device: torch.device
               ) -> dict[int, torch.Tensor | None] | None:
    """The step's token rows (decodes' first, then each prefill's chunk, as ``_prepare``
    lays them out) by LoRA adapter: None for an adapter that has every row, and None
    where no sequence has one."""
    rows: dict[int, list[int]] = {}
    start = 0
    for s in ordered:
        if s.seq.lora_id:
            rows.setdefault(s.seq.lora_id, []).extend(range(start, start + s.num_new_tokens))
        start += s.num_new_tokens
    if not rows:
        return None
    return {lora_id: None if len(r) == start else
            torch.tensor(r, dtype=torch.long, device=device) for lora_id, r in rows.items()}


def _pool_rows(seq: Sequence, start: int, n: int) -> tuple[int, int, int, bool]:
    """A pooling sequence's chunk of ``n`` positions at hidden row ``start``: the rows its
    pooling takes (``_LogitsPlan.pool``). MEAN takes every position not pooled yet (a
    chunk recomputed after a preemption adds none twice), LAST the prompt's last, CLS the
    first."""
    ctx, total = seq.num_computed_tokens, seq.num_prompt_tokens
    end = ctx + n
    if seq.pooling == "MEAN":
        first = max(ctx, seq.pool_count)
        last = end
    elif seq.pooling == "LAST":
        first, last = total - 1, (total if end == total else total - 1)
    else:  # CLS
        first, last = 0, (1 if ctx == 0 else 0)
    count = max(0, last - first)
    return start + first - ctx, count, first, end == total
