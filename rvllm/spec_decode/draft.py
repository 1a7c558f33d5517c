"""Proposers that run a model: a smaller draft model with a KV cache of its own
(``draft_model``), or the target's own first layers under its final norm and LM head
(``self_draft``), which share the target's weights and those layers' KV cache.

Both propose greedily, after the step is scheduled: the engine appends k placeholder
tokens before scheduling (so the scheduler gives them slots, as it does n-gram drafts),
and ``ModelDrafter.fill`` then writes the draft's tokens in their place, running the
draft over the target's block tables. A greedy draft puts all its probability on its
token, so verification stays exact for sampled requests too: a draft is kept where it
equals the target's own sample (``layers.sampler.verify_drafts``).
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from rvllm.engine.sequence import Sequence
from rvllm.forward_context import AttentionMetadata, add_block_tables, set_forward_context
from rvllm.layers.backend import use_triton
from rvllm.layers.sampler import apply_grammar_masks_

# The most positions of one sequence a draft model computes into its cache in one pass.
CATCH_UP_TOKENS = 512


def self_draft_model(model: nn.Module, num_layers: int) -> nn.Module:
    """The target ``model``'s first ``num_layers`` decoder layers, its final norm and LM
    head, as a model of its own: every weight and these layers' KV caches are the
    target's (nothing is copied). The target's cache already holds these layers' keys
    and values for every computed position, so the draft never recomputes a prompt."""
    decoder = model.model
    layers = list(decoder.layers)
    if not 1 <= num_layers < len(layers):
        raise ValueError(f"speculative_config num_draft_layers ({num_layers}) must be "
                         f"from 1 to below the model's {len(layers)} layers.")
    draft_decoder = copy.copy(decoder)
    draft_decoder._modules = dict(decoder._modules)
    draft_decoder._modules["layers"] = nn.ModuleList(layers[:num_layers])
    draft_decoder.__dict__.pop("_decoder_step_plan", None)  # the compiled step's, per stack
    draft = copy.copy(model)
    draft._modules = dict(model._modules)
    draft._modules["model"] = draft_decoder
    return draft


class ModelDrafter:
    """Greedy drafts from ``model`` over the target's block tables.

    ``own_cache``: the draft model's KV cache is its own allocation (as many blocks as
    the target's, so the same block ids index it), and each sequence's prompt and output
    are computed into it once, on its first draft, then kept up with the tokens the
    target commits. Without it (self-draft) the cache is the target's."""

    def __init__(self, model: nn.Module, block_size: int, device: torch.device,
                 own_cache: bool) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.own_cache = own_cache
        # Own cache: sequence id -> (positions computed into the draft's cache, the block
        # ids they lie in). A sequence whose blocks changed (preempted, swapped) starts over.
        self._computed: dict[int, tuple[int, tuple[int, ...]]] = {}

    def fill(self, seqs: list[tuple[Sequence, int]], live: set[int]) -> None:
        """Write ``count`` greedy drafts over each sequence's last ``count`` tokens (the
        placeholders): each sequence's last committed token is at position
        ``num_tokens - count - 1``. ``live``: the ids of the sequences still running
        (the others' bookkeeping is dropped)."""
        if self.own_cache:
            for seq_id in [i for i in self._computed if i not in live]:
                del self._computed[seq_id]
            self._catch_up([seq for seq, _ in seqs])
        by_count: dict[int, list[Sequence]] = {}
        for seq, count in seqs:
            by_count.setdefault(count, []).append(seq)
        with torch.inference_mode():
            for count, group in by_count.items():
                self._draft(group, count)

    def _catch_up(self, seqs: list[Sequence]) -> None:
        """Compute into the draft's own cache every committed position but the last of
        each sequence that it lacks, as prefill chunks: a forward pass takes each
        sequence's next ``CATCH_UP_TOKENS`` at most."""
        chunks = []
        for seq in seqs:
            last = seq.num_tokens - len(seq.spec_tokens) - 1  # the last committed token
            done, blocks = self._computed.get(seq.seq_id, (0, ()))
            if tuple(seq.block_table[:len(blocks)]) != blocks:
                done = 0
            # Past the last committed token, what the draft wrote was its own guesses.
            done = min(done, last)
            if done < last:
                chunks.append((seq, done, last - done))
            self._note(seq, done)
        while chunks:
            now = [(seq, done, min(n, CATCH_UP_TOKENS)) for seq, done, n in chunks]
            with torch.inference_mode():
                self._forward(now, logits=False)
            for seq, done, n in now:
                self._note(seq, done + n)
            chunks = [(seq, done + CATCH_UP_TOKENS, n - CATCH_UP_TOKENS)
                      for seq, done, n in chunks if n > CATCH_UP_TOKENS]

    def _note(self, seq: Sequence, computed: int) -> None:
        if self.own_cache:
            blocks = tuple(seq.block_table[:-(-computed // self.block_size)])
            self._computed[seq.seq_id] = (computed, blocks)

    def _draft(self, seqs: list[Sequence], count: int) -> None:
        """``count`` greedy steps of ``seqs`` from each one's last committed token: one
        compiled call on the CPU where the model has it, else (and for sequences with a
        structured-output grammar, whose drafts follow it) a forward pass a step."""
        plain = [seq for seq in seqs if seq.grammar is None]
        if plain and self._draft_compiled(plain, count):
            seqs = [seq for seq in seqs if seq.grammar is not None]
        if seqs:
            self._draft_stepwise(seqs, count)

    def _draft_compiled(self, seqs: list[Sequence], count: int) -> bool:
        """The greedy steps as one compiled CPU call (``decode_greedy_steps``); False
        where the model has none for this step."""
        steps = getattr(self.model, "decode_greedy_steps", None)
        if steps is None:
            return False
        bs, rows = self.block_size, len(seqs)
        starts = [seq.num_tokens - count - 1 for seq in seqs]
        ids, pos = np.empty(rows, np.int64), np.array(starts, np.int64)
        width = (max(starts) + count - 1) // bs + 1
        tables = np.zeros((rows, width), np.int64)
        for i, (seq, start) in enumerate(zip(seqs, starts)):
            ids[i] = seq.token_ids[start]
            used = seq.block_table[:width]
            tables[i, :len(used)] = used
        found = steps(ids, pos, tables, bs, count, np.full((rows, 1), -1, np.int64))
        if found is None:
            return False
        tokens = np.array(found[0], np.int64).T.tolist()  # [seq][step]
        for seq, start, drafts in zip(seqs, starts, tokens):
            self._place(seq, start, drafts[:count])
        return True

    def _draft_stepwise(self, seqs: list[Sequence], count: int) -> None:
        """A forward pass a step; a sequence's grammar masks each step's logits and is
        moved past each draft, then rolled back (the verifying step moves it again)."""
        starts = [seq.num_tokens - count - 1 for seq in seqs]
        constrained = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
        moved = [0] * len(seqs)
        try:
            for step in range(count):
                chunks = [(seq, start + step, 1) for seq, start in zip(seqs, starts)]
                logits = self._forward(chunks)
                live = [i for i in constrained if not seqs[i].grammar.is_terminated()]
                if live:
                    apply_grammar_masks_(logits, live, [seqs[i].grammar for i in live])
                for i, (seq, token) in enumerate(zip(seqs, logits.argmax(dim=-1).tolist())):
                    seq.token_ids[starts[i] + 1 + step] = token
                    seq.spec_tokens[step] = token
                    if i in live and seq.grammar.accept(token):
                        moved[i] += 1
        finally:
            for i in constrained:
                if moved[i]:
                    seqs[i].grammar.rollback(moved[i])
        for seq, start in zip(seqs, starts):
            self._note(seq, start + count)

    def _place(self, seq: Sequence, start: int, drafts: list[int]) -> None:
        seq.token_ids[start + 1:start + 1 + len(drafts)] = drafts
        seq.spec_tokens = list(drafts)
        self._note(seq, start + len(drafts))

    def _forward(self, chunks: list[tuple[Sequence, int, int]], logits: bool = True
                 ) -> torch.Tensor | None:
        """One forward pass of the draft over ``chunks`` (sequence, first position, count),
        each attending over the cache before it; with ``logits``, each chunk's logits at
        its last position [len(chunks), V], float32."""
        from rvllm.executor.model_runner import add_chunk

        bs, dev = self.block_size, self.device
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        prefills = [add_chunk(seq, start, n, bs, dev, ids, pos, slots)
                    for seq, start, n in chunks]
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decode_tokens=0, decode_slots=None, decode_seq_lens=None,
            prefills=prefills, block_size=bs)
        if use_triton():
            add_block_tables(metadata, bs)
        with set_forward_context(metadata):
            hidden = self.model(torch.tensor(ids, dtype=torch.long, device=dev),
                                torch.tensor(pos, dtype=torch.long, device=dev))
            if not logits:
                return None
            last = torch.tensor([c.token_start + c.num_tokens - 1 for c in prefills],
                                dtype=torch.long, device=dev)
            return self.model.compute_logits(hidden[last]).float()
