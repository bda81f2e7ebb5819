"""TOVA (token omission via attention): keep the keys the newest query attends to most.

At each decode step the key with the lowest attention from that step's query is evicted; there is no
accumulated score (the cache's score column holds the last step's mass: the policy's `step_scores` trait). As in
the TOVA paper and kvpress's TOVAPress, the attention is averaged over all heads of the layer, so one token
leaves every KV head of a layer at once: the rank is the sum over the KV heads (each already the sum over its
query heads), which orders keys as the mean does. The prompt is cut the same way, by the last prompt query's
attention (score window 1), and the newest token is kept (the budget's recent share, 1 by default).

Every KV head of a sequence therefore holds the same tokens in the same slots: the prefill packs one keep mask
for all heads, and every step writes the new token to the lowest free slot and frees one shared victim, so the
(b, g, s) columns stay aligned slot by slot and the sum over g adds up the same token's mass.
"""
from __future__ import annotations

from torch import Tensor

from flexgen_h2o.kv.h2o import H2OPolicy


class TOVAPolicy(H2OPolicy):
    """Exact H2O's victim rule on the layer's summed last-step attention."""

    def rank(self, scores: Tensor, positions: Tensor) -> Tensor:
        return scores.sum(dim=1, keepdim=True).expand_as(scores)
