"""When a sequence is done: EOS, stop tokens, stop strings, max_tokens, max_model_len."""

from __future__ import annotations

from rvllm.engine.sequence import Sequence, SequenceStatus


def check_stop(seq: Sequence, max_model_len: int, new_text_len: int) -> SequenceStatus | None:
    """Inspect the token just appended (and ``new_text_len`` characters of new text).
    A stop string found in the text is cut away (or kept, with include_stop_str_in_output)."""
    params = seq.params
    token = seq.token_ids[-1]
    if seq.num_output_tokens >= params.min_tokens:
        if token in params.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            seq.stop_reason = token
            return SequenceStatus.FINISHED_STOPPED
        if params.stop and _find_stop_string(seq, new_text_len):
            return SequenceStatus.FINISHED_STOPPED
    if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= max_model_len:
        return SequenceStatus.FINISHED_LENGTH
    return None


def _find_stop_string(seq: Sequence, new_text_len: int) -> bool:
    best: tuple[int, str] | None = None
    for stop in seq.params.stop:  # type: ignore[union-attr]
        # Only a match that overlaps the new text is new.
        start = max(0, len(seq.text) - new_text_len - len(stop) + 1)
        idx = seq.text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    if best is None:
        return False
    idx, stop = best
    end = idx + len(stop) if seq.params.include_stop_str_in_output else idx
    seq.text = seq.text[:end]
    seq.stop_reason = stop
    return True
