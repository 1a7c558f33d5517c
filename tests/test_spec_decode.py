"""Speculative decoding's parts on their own: the n-gram proposer's matching, greedy
verification, rejection sampling's output distribution, and the configuration's checks."""

from __future__ import annotations

import pytest
import torch

from rvllm.spec_decode.config import SpeculativeConfig
from rvllm.spec_decode.ngram import propose_ngram
from rvllm.spec_decode.rejection import rejection_sample, verify_greedy


@pytest.mark.parametrize(("tokens", "k", "lo", "hi", "expected"), [
    ([1, 2, 3, 4, 1, 2], 2, 1, 3, [3, 4]),          # "1 2" seen before: what followed it
    ([1, 2, 3, 4, 1, 2], 5, 1, 3, [3, 4, 1, 2]),    # stops where the sequence ends
    ([5, 1, 2, 9, 7, 1, 2, 8, 1, 2], 1, 2, 2, [8]),  # the latest earlier match wins
    ([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 2, 1, 3, [9, 2]),  # the longest n first
    ([1, 2, 3], 3, 1, 3, []),                        # no earlier occurrence
    ([4, 4, 4, 4], 2, 2, 2, [4]),                    # overlapping matches
    ([1, 2, 3, 1], 2, 2, 3, []),                     # below lookup_min: nothing
])
def test_ngram_proposer_matches_by_hand(tokens, k, lo, hi, expected):
    assert propose_ngram(tokens, k, lo, hi) == expected


def test_greedy_verification_keeps_drafts_while_they_equal_the_argmax():
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all kept, plus bonus
    assert verify_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]        # corrected at 2nd
    assert verify_greedy([4, 6, 7, 8], [5, 6, 7]) == [4]
    assert verify_greedy([3], []) == [3]


# Chi-square critical value at p = 0.001 for 5 categories (4 degrees of freedom).
_CHI2_4_DOF_0_001 = 18.47


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("proposer", ["model", "ngram"])
def test_rejection_sampling_reproduces_the_target_distribution(proposer):
    g = torch.Generator().manual_seed(0)
    target = torch.tensor([[0.40, 0.25, 0.15, 0.12, 0.08],
                           [0.10, 0.20, 0.30, 0.25, 0.15]])
    draft_probs = torch.tensor([[0.05, 0.15, 0.50, 0.20, 0.10]])
    first = torch.zeros(5)
    second_after_accept = torch.zeros(5)
    accepted = 0
    draws = 20000
    for _ in range(draws):
        if proposer == "model":
            token = int(torch.multinomial(draft_probs[0], 1, generator=g))
            out = rejection_sample(target, [token], draft_probs, g)
        else:
            token = 2  # a proposer that is sure of its token
            out = rejection_sample(target, [token], None, g)
        first[out[0]] += 1
        if len(out) == 2:
            accepted += 1
            second_after_accept[out[1]] += 1
    assert _chi_square(first, target[0]) < _CHI2_4_DOF_0_001
    assert _chi_square(second_after_accept, target[1]) < _CHI2_4_DOF_0_001
    # The acceptance rate is sum(min(p, q)) for a model draft and p(token) for n-gram.
    rate = float(torch.minimum(target[0], draft_probs[0]).sum()) if proposer == "model" \
        else float(target[0, 2])
    assert abs(accepted / draws - rate) < 0.02


def test_rejection_sampling_is_reproducible_with_a_seed():
    target = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(1)), -1)
    runs = [rejection_sample(target, [3, 7, 9], None, torch.Generator().manual_seed(5))
            for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize(("value", "message"), [
    ('{"method": "medusa", "num_speculative_tokens": 3}', "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 3, "k": 2}, "no key"),
    ("{not json", "JSON"),
])
def test_bad_speculative_configs_are_refused(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_self_draft_layers_default_to_a_quarter_and_stay_below_the_model():
    config = SpeculativeConfig.parse({"method": "self_draft", "num_speculative_tokens": 2})
    assert config.draft_layers(32) == 8 and config.draft_layers(3) == 1
    too_many = SpeculativeConfig.parse({"method": "self_draft", "num_speculative_tokens": 2,
                                        "num_draft_layers": 4})
    with pytest.raises(ValueError, match="num_draft_layers"):
        too_many.draft_layers(4)
    assert SpeculativeConfig.parse('{"method": "[ngram]", "num_speculative_tokens": 4}'
                                   ).method == "ngram"
