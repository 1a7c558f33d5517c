"""Verification of proposed tokens against the target model's distributions.

Greedy: the drafts are kept while each equals the target's argmax; the first that does not
is replaced by the argmax, so the output is exactly greedy decoding's. Sampling: exact
rejection sampling (Leviathan et al., 2023): draft x from q is kept with probability
min(1, p(x)/q(x)); on the first rejection a token is drawn from max(0, p - q), normalised;
when every draft is kept a bonus token is drawn from the next position's p. The tokens'
distribution is then the target's, whatever q is. A proposer without probabilities (n-gram
lookup) has q = 1 at its token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def verify_greedy(target_argmax: Sequence[int], draft: Sequence[int]) -> list[int]:
    """``target_argmax`` has len(draft) + 1 entries (the last is the bonus position): the
    accepted drafts, then the target's own token."""
    out = []
    for i, token in enumerate(draft):
        if token != target_argmax[i]:
            break
        out.append(token)
    out.append(int(target_argmax[len(out)]))
    return out


def rejection_sample(target_probs: torch.Tensor, draft: Sequence[int],
                     draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None = None) -> list[int]:
    """``target_probs`` [len(draft) + 1, V]; ``draft_probs`` [len(draft), V] or None (a
    proposer that puts all its mass on its token). Returns the accepted drafts followed by
    one token from the target (the correction, or the bonus)."""
    out = []
    for i, token in enumerate(draft):
        p = target_probs[i]
        q_token = 1.0 if draft_probs is None else float(draft_probs[i, token])
        u = float(torch.rand((), generator=generator, device=p.device))
        if q_token > 0 and u * q_token < float(p[token]):  # u < p/q without dividing
            out.append(int(token))
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[token] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_(min=0.0)
        total = float(residual.sum())
        if total <= 0.0:  # p == q: any draw from p is exact
            residual, total = p, float(p.sum())
        out.append(int(torch.multinomial(residual / total, 1, generator=generator)))
        return out
    bonus = target_probs[len(draft)]
    out.append(int(torch.multinomial(bonus / bonus.sum(), 1, generator=generator)))
    return out
