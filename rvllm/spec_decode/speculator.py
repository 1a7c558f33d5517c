"""Speculative decoding around each engine step: which sequences propose and how many
tokens, the drafts appended before the scheduler runs and trimmed to what it scheduled,
and after verification the kept tokens' bookkeeping, each sequence's back-off where its
drafts do not pay, and the counters under vLLM's metric names.

The engine calls, in a step: ``propose`` (before scheduling), ``trim`` and ``fill``
(after), ``time_step`` and ``settle`` (after the step ran). Verification itself happens in
the sampler (``layers.sampler.verify_drafts``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from rvllm.engine.sequence import Sequence
from rvllm.layers.sampler import speculation_allowed
from rvllm.spec_decode.config import SpeculativeConfig
from rvllm.spec_decode.ngram import propose_ngram

if TYPE_CHECKING:
    from rvllm.engine.scheduler import SchedulerOutput
    from rvllm.executor.model_runner import SeqStepOutput
    from rvllm.spec_decode.draft import ModelDrafter

logger = logging.getLogger("rvllm")

# The longest a sequence waits before proposing again after drafts that did not pay.
MAX_BACKOFF_STEPS = 64


class Speculator:
    """What ``--speculative-config`` adds to the engine's step; ``drafter`` is the draft
    model or self-draft (None for n-gram lookup)."""

    def __init__(self, config: SpeculativeConfig, drafter: ModelDrafter | None) -> None:
        self.config = config
        self.drafter = drafter
        self.stats = SpecDecodeStats(config)

    def propose(self, running: Iterable[Sequence], max_model_len: int) -> None:
        """Propose the next tokens of every running sequence that decodes and may
        speculate, appended to its tokens so that the scheduler gives them slots."""
        running = list(running)
        config, stats = self.config, self.stats
        if len(running) > config.disable_by_batch_size:
            return
        for seq in running:
            if seq.num_computed_tokens != seq.num_tokens - 1 or not speculation_allowed(
                    seq.params, seq.num_output_tokens):
                continue
            if seq.spec_skip > 0:
                seq.spec_skip -= 1
                continue
            if (seq.spec_gain is None and seq.spec_backoff == 0 and self.drafter is not None
                    and not stats.worth_it(stats.gain)):
                # A model's drafts cost a pass each: where they have not paid lately on
                # the other sequences, a new one waits the longest before it tries.
                seq.spec_backoff = seq.spec_skip = MAX_BACKOFF_STEPS
                continue
            if seq.spec_backoff == 0 and not stats.worth_it(seq.spec_gain):
                # Not paying lately: wait, then one try (a back-off's end) to measure anew.
                back_off(seq)
                continue
            # Never past max_tokens or the context: the drafts and the target's token.
            k = min(config.num_speculative_tokens,
                    seq.max_tokens - seq.num_output_tokens - 1,
                    max_model_len - seq.num_tokens - 1)
            if k < 1:
                continue
            if self.drafter is not None:
                # Placeholders: the draft model fills them once the step is scheduled.
                draft = [seq.token_ids[-1]] * k
            else:
                draft = propose_ngram(seq.token_ids, k, config.prompt_lookup_min,
                                      config.prompt_lookup_max)
            if draft:
                seq.spec_tokens = draft
                seq.token_ids.extend(draft)

    @staticmethod
    def trim(sched: SchedulerOutput, seqs: Iterable[Sequence]) -> None:
        """Keep of each sequence's drafts the ones its scheduled tokens cover: ``seqs``
        are every sequence that may hold drafts (running, preempted, swapped); one not
        scheduled loses them."""
        scheduled = {id(s.seq): s.num_new_tokens for s in sched.scheduled}
        for seq in seqs:
            if seq.spec_tokens:
                keep = max(0, min(len(seq.spec_tokens), scheduled.get(id(seq), 1) - 1))
                drop_drafts(seq, keep)

    def fill(self, sched: SchedulerOutput, running: Iterable[Sequence]) -> None:
        """The draft model's (or self-draft's) tokens in place of the placeholders that
        each scheduled sequence kept; nothing to do for n-gram drafts."""
        if self.drafter is None:
            return
        pending = [(s.seq, len(s.seq.spec_tokens)) for s in sched.scheduled
                   if s.seq.spec_tokens]
        if pending:
            self.drafter.fill(pending, {seq.seq_id for seq in running})

    def settle(self, outputs: list[SeqStepOutput]) -> None:
        """After verification: drafts out of the tokens (the engine appends the kept ones
        as tokens), the counters, each sequence's tokens per verifying step (an average
        over its last few), and its back-off: one that kept nothing waits before it
        proposes again."""
        for out in outputs:
            seq = out.seq
            if not seq.spec_tokens:
                continue
            drop_drafts(seq)
            self.stats.add(out.num_drafts, out.num_accepted)
            gain = 1.0 + out.num_accepted
            seq.spec_gain = gain if seq.spec_gain is None else 0.7 * seq.spec_gain + 0.3 * gain
            if out.num_accepted == 0 or not self.stats.worth_it(seq.spec_gain):
                back_off(seq)
            else:
                seq.spec_backoff = 0
        self.stats.maybe_log()


def drop_drafts(seq: Sequence, keep: int = 0) -> None:
    """Take a sequence's drafts past the first ``keep`` back out of its tokens."""
    extra = len(seq.spec_tokens) - keep
    if extra > 0:
        del seq.token_ids[len(seq.token_ids) - extra:]
    seq.spec_tokens = seq.spec_tokens[:keep]


def back_off(seq: Sequence) -> None:
    """Wait 1, 2, 4, ... up to 64 steps before proposing again, then try once: a sequence
    whose text turns to quoting is found again, at the cost of one verifying step in 64
    where it does not pay."""
    seq.spec_backoff = min(MAX_BACKOFF_STEPS, max(1, 2 * seq.spec_backoff))
    seq.spec_skip = seq.spec_backoff


class SpecDecodeStats:
    """Speculative decoding's counters, under vLLM's metric names, and its log line."""

    LOG_INTERVAL_S = 10.0

    def __init__(self, config: SpeculativeConfig | None) -> None:
        k = config.num_speculative_tokens if config is not None else 0
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k
        self._logged = (0, 0, time.monotonic())
        # Averages of a verifying step's and a plain decode step's seconds.
        self.verify_s: float | None = None
        self.decode_s: float | None = None
        # Tokens per verifying step over every sequence's recent ones.
        self.gain: float | None = None

    def time_step(self, sched: SchedulerOutput, seconds: float) -> None:
        """A step's time, into the average of verifying steps or of plain decode steps
        (steps with a prefill in them count in neither)."""
        if any(s.seq.spec_tokens for s in sched.scheduled):
            self.verify_s = _ema(self.verify_s, seconds)
        elif all(s.num_new_tokens == 1 for s in sched.scheduled):
            self.decode_s = _ema(self.decode_s, seconds)

    def worth_it(self, gain: float | None) -> bool:
        """Whether a sequence that has made ``gain`` tokens per verifying step lately
        should propose: a verifying step must make more tokens than it costs decode
        steps (on the CPU a step of five rows of SmolLM2's packed weights cost about 2.6
        one-row steps). Unknown costs or gain: try."""
        if gain is None or self.verify_s is None or self.decode_s is None:
            return True
        return gain > self.verify_s / self.decode_s

    def add(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.gain = _ema(self.gain, 1.0 + accepted, 0.1)
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1

    def maybe_log(self) -> None:
        drafts, accepted, at = self._logged
        now = time.monotonic()
        if now - at < self.LOG_INTERVAL_S or self.num_drafts == drafts:
            return
        new_drafts = self.num_drafts - drafts
        new_accepted = self.num_accepted_tokens - accepted
        logger.info("speculative decoding: mean acceptance length %.2f over %d drafts "
                    "(%d of their tokens accepted)", 1 + new_accepted / new_drafts,
                    new_drafts, new_accepted)
        self._logged = (self.num_drafts, self.num_accepted_tokens, now)

    def snapshot(self) -> dict[str, Any]:
        return {"spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_accepted_per_pos": tuple(self.accepted_per_pos)}


def _ema(average: float | None, value: float, weight: float = 0.2) -> float:
    return value if average is None else (1.0 - weight) * average + weight * value
