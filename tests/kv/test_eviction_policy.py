"""Eviction policies on hand-built tensors, and against the plain-Python rule of tests/reference/h2o_masked.py.

Shapes: scores and positions are (b, g, s); position -1 marks an empty / pad / evicted slot.
"""
from __future__ import annotations

import random
import zlib

import pytest
import torch

from flexgen_h2o.kv import NO_VICTIM, Budget, get_policy, pack_kept
from tests.reference.h2o_masked import RULE_FOR_POLICY
from tests.reference.h2o_rule import ref_keep_prefill, ref_victim


def col(scores, positions):
    """One (b=1, g=1) column."""
    return torch.tensor([[scores]], dtype=torch.float32), torch.tensor([[positions]], dtype=torch.long)


def victim(policy, scores, positions, budget, **kw):
    return int(get_policy(policy).choose_victim(scores, positions, budget, **kw)[0, 0])


def test_exact_victim_is_weakest_candidate():
    s, p = col([5.0, 1.0, 3.0, 2.0, 0.5], [0, 1, 2, 3, 4])
    assert victim("h2o", s, p, Budget(0, 2, 2)) == 1           # recent {3, 4} protected; argmin of {0, 1, 2}


def test_exact_drops_a_weak_leaving_token_port_admits_it():
    # heavy hitters at positions 0 and 1, position 2 leaves the window {3, 4}
    s, p = col([5.0, 3.0, 0.1, 0.2, 0.3], [0, 1, 2, 3, 4])
    assert victim("h2o", s, p, Budget(0, 2, 2)) == 2
    assert victim("h2o-port", s, p, Budget(0, 2, 2)) == 1      # the leaving token is always promoted


def test_avg_ranks_by_attention_per_query_seen():
    # newest position 4: positions 0, 1, 2 were seen by 5, 4 and 3 queries -> averages 0.8, 0.375, 0.4
    s, p = col([4.0, 1.5, 1.2, 0.1, 0.1], [0, 1, 2, 3, 4])
    assert victim("h2o", s, p, Budget(0, 2, 2)) == 2             # lowest sum
    assert victim("h2o-avg", s, p, Budget(0, 2, 2)) == 1         # lowest average
    # the same tokens scattered over slots around an empty one: the count follows positions, not slots
    s, p = col([0.1, 1.2, 0.0, 4.0, 1.5, 0.1], [3, 2, -1, 0, 1, 4])
    assert victim("h2o-avg", s, p, Budget(0, 2, 2)) == 4


def test_avg_prefill_counts_real_queries_only():
    # 2 pads, 4 real tokens (newest 3): positions 0, 1, 2 were seen by 4, 3 and 2 real queries
    s, p = col([100.0, 0.0, 2.0, 1.4, 1.1, 0.3], [-1, -1, 0, 1, 2, 3])
    assert get_policy("h2o").select_prefill(s, p, Budget(0, 1, 1))[0, 0].tolist() == \
        [False, False, True, False, False, True]                 # sum: position 0 (2.0)
    assert get_policy("h2o-avg").select_prefill(s, p, Budget(0, 1, 1))[0, 0].tolist() == \
        [False, False, False, False, True, True]                 # average: position 2 (0.55 > 0.5 > 0.47)
    with pytest.raises(ValueError, match="column sums"):
        get_policy("h2o-avg").select_prefill(None, p, Budget(0, 1, 1))


def test_slot_order_is_irrelevant():
    # same tokens as above, scattered over slots with an empty slot in the middle
    s, p = col([0.3, 5.0, 0.0, 0.1, 3.0, 0.2], [4, 0, -1, 2, 1, 3])
    assert victim("h2o", s, p, Budget(0, 2, 2)) == 3
    assert victim("h2o-port", s, p, Budget(0, 2, 2)) == 4
    assert victim("local", s, p, Budget(0, 0, 4)) == 1          # oldest
    assert victim("sink", s, p, Budget(1, 0, 3)) == 4           # oldest non-sink: position 1


def test_ties_go_to_the_smallest_position():
    s, p = col([1.0, 1.0, 1.0, 9.0, 9.0], [3, 1, 2, 4, 0])
    assert victim("h2o", s, p, Budget(0, 2, 1)) == 1            # candidates {0, 1, 2, 3}, tie at 1.0
    keep = get_policy("h2o").select_prefill(*col([1.0, 1.0, 1.0, 1.0, 1.0], [0, 1, 2, 3, 4]), Budget(0, 2, 1))
    assert keep[0, 0].tolist() == [False, False, True, True, True]   # ties keep the newer tokens


def test_pads_are_never_kept_or_chosen():
    s, p = col([100.0, 0.0, 0.0, 2.0, 1.0, 3.0], [-1, -1, 0, 1, 2, 3])
    assert victim("h2o", s, p, Budget(0, 2, 1)) == 2
    keep = get_policy("h2o").select_prefill(s, p, Budget(0, 1, 1))
    assert keep[0, 0].tolist() == [False, False, False, True, False, True]
    assert get_policy("full").select_prefill(None, p, Budget(0, 0, 9))[0, 0].tolist() == [False, False] + [True] * 4


def test_fill_first():
    s, p = col([1.0, 0.1, 2.0, 3.0, 0.0], [0, 1, 2, 3, -1])
    for name in ("h2o", "h2o-port", "h2o-avg", "local", "sink", "random"):
        assert victim(name, s, p, Budget(0, 2, 2), generator=torch.Generator().manual_seed(0)) == NO_VICTIM
    assert victim("h2o", s, p, Budget(0, 1, 2)) == 1


def test_padded_batch_budgets_per_sequence():
    scores = torch.tensor([[[0.5, 0.1, 0.2, 0.9, 0.4]], [[0.0, 0.0, 0.3, 0.2, 0.1]]])
    positions = torch.tensor([[[0, 1, 2, 3, 4]], [[-1, -1, 0, 1, 2]]])     # 5 and 3 real tokens
    v = get_policy("h2o").choose_victim(scores, positions, Budget(0, 2, 2))
    assert v.tolist() == [[1], [NO_VICTIM]]
    keep = get_policy("h2o").select_prefill(scores, positions, Budget(0, 2, 1))
    assert keep.tolist() == [[[True, False, False, True, True]], [[False, False, True, True, True]]]


def test_gqa_columns_choose_independently():
    # b=2, g=2: each (sequence, KV head) column has its own scores, hence its own victim
    positions = torch.arange(4).expand(2, 2, 4)
    scores = torch.tensor([[[1.0, 2.0, 3.0, 4.0], [3.0, 2.0, 1.0, 4.0]],
                           [[2.0, 1.0, 3.0, 4.0], [1.0, 3.0, 2.0, 4.0]]])
    v = get_policy("h2o").choose_victim(scores, positions, Budget(0, 2, 1))
    assert v.tolist() == [[0, 2], [1, 0]]
    keep = get_policy("h2o").select_prefill(scores, positions[:, 0], Budget(0, 1, 1))   # (b, p) positions broadcast
    assert keep.sum(-1).tolist() == [[2, 2], [2, 2]]
    assert keep[0, 1].tolist() == [True, False, False, True]


def test_recent_zero_new_token_is_a_candidate():
    s, p = col([5.0, 4.0, 0.1], [0, 1, 2])                     # position 2 is the token just written
    assert victim("h2o", s, p, Budget(0, 2, 0)) == 2
    assert victim("h2o-port", s, p, Budget(0, 2, 0)) == 1      # the port always admits the newest


def test_heavy_zero_is_a_pure_window():
    s, p = col([0.0, 9.0, 5.0, 1.0], [0, 1, 2, 3])
    for name in ("h2o", "h2o-port"):
        assert victim(name, s, p, Budget(1, 0, 2)) == 1         # the token leaving the window, whatever its score


def test_random_policy_only_evicts_candidates_and_is_seeded():
    s, p = col([0.0] * 8, [0, 1, 2, 3, 4, 5, 6, -1])
    gen = torch.Generator().manual_seed(1)
    seen = {victim("random", s, p, Budget(1, 3, 2), generator=gen) for _ in range(200)}
    assert seen == {1, 2, 3, 4}                                   # not the sink, the window {5, 6} or the pad
    a = [victim("random", s, p, Budget(1, 3, 2), generator=torch.Generator().manual_seed(7)) for _ in range(3)]
    assert len(set(a)) == 1
    keep = get_policy("random").select_prefill(None, p, Budget(1, 2, 2), generator=gen)
    assert keep[0, 0].sum() == 5 and keep[0, 0, [0, 5, 6]].all() and not keep[0, 0, 7]


def test_full_never_evicts_and_registry_flags():
    s, p = col([0.0] * 4, [0, 1, 2, 3])
    assert victim("full", s, p, Budget(0, 0, 1)) == NO_VICTIM
    assert {n: get_policy(n).needs_scores for n in ("full", "h2o", "h2o-port", "h2o-avg", "local", "sink",
                                                     "random")} == \
        {"full": False, "h2o": True, "h2o-port": True, "h2o-avg": True, "local": False, "sink": False,
         "random": False}
    with pytest.raises(ValueError, match="unknown eviction policy"):
        get_policy("lru")
    with pytest.raises(ValueError, match="column sums"):
        get_policy("h2o").select_prefill(None, p, Budget(0, 1, 1))


def _random_columns(rng: random.Random, b: int, g: int, s: int, ties: bool):
    """Positions: each column holds a random subset of a sequence's tokens in random slots, rest empty."""
    scores = torch.empty(b, g, s)
    positions = torch.full((b, g, s), -1, dtype=torch.long)
    for bi in range(b):
        length = rng.randint(1, s + 3)
        for gi in range(g):
            n_valid = rng.randint(0, min(s, length))
            toks = sorted(rng.sample(range(length), n_valid))
            slots = rng.sample(range(s), n_valid)
            for t, sl in zip(toks, slots):
                positions[bi, gi, sl] = t
            for sl in range(s):
                scores[bi, gi, sl] = rng.randint(0, 3) / 4 if ties else rng.random() * 10
    return scores, positions


@pytest.mark.parametrize("policy", ["h2o", "h2o-port", "local", "sink"])
def test_victims_match_brute_force(policy):
    rng = random.Random(zlib.crc32(policy.encode()))      # str hash() changes per process
    for trial in range(60):
        sink, heavy, recent = rng.randint(0, 2), rng.randint(0, 3), rng.randint(0, 3)
        if policy == "h2o-port":
            heavy = max(heavy, 1)
        if policy in ("local", "sink"):
            heavy, recent = 0, heavy + recent
            sink = 0 if policy == "local" else sink
        budget = Budget(sink, heavy, recent, policy=policy)
        if budget.budget == 0:
            continue
        scores, positions = _random_columns(rng, 2, 2, budget.budget + 2, ties=trial % 2 == 0)
        got = get_policy(policy).choose_victim(scores, positions, budget)
        for bi in range(2):
            for gi in range(2):
                want = ref_victim(scores[bi, gi].tolist(), positions[bi, gi].tolist(), sink, heavy, recent,
                                  RULE_FOR_POLICY[policy])
                assert int(got[bi, gi]) == (NO_VICTIM if want is None else want), (trial, bi, gi, budget)


@pytest.mark.parametrize("policy", ["h2o", "local", "sink"])
def test_prefill_matches_brute_force(policy):
    rng = random.Random(7 + len(policy))
    for trial in range(60):
        b, g, p = 3, 2, rng.randint(1, 12)
        sink, heavy, recent = rng.randint(0, 2), rng.randint(0, 4), rng.randint(0, 4)
        if policy != "h2o":
            heavy, recent = 0, heavy + recent
            sink = 0 if policy == "local" else sink
        budget = Budget(sink, heavy, recent, policy=policy)
        n_pad = [rng.randint(0, p - 1) for _ in range(b)]
        positions = torch.tensor([[-1] * k + list(range(p - k)) for k in n_pad])[:, None].expand(b, g, p)
        levels = 3 if trial % 2 == 0 else 1000                 # half the trials full of ties
        scores = torch.tensor([[[rng.randint(0, levels) / levels for _ in range(p)] for _ in range(g)]
                               for _ in range(b)])
        keep = get_policy(policy).select_prefill(scores if policy == "h2o" else None, positions, budget)
        for bi in range(b):
            for gi in range(g):
                want = ref_keep_prefill(scores[bi, gi].tolist(), positions[bi, gi].tolist(), sink, heavy, recent)
                assert set(torch.nonzero(keep[bi, gi]).flatten().tolist()) == want, (trial, bi, gi, budget)


def test_pack_kept():
    keep = torch.tensor([[[False, True, False, True, True]], [[True, False, False, False, False]]])
    src, filled = pack_kept(keep, 4)
    assert src.tolist() == [[[1, 3, 4, 0]], [[0, 0, 0, 0]]]
    assert filled.tolist() == [[[True, True, True, False]], [[True, False, False, False]]]
    assert pack_kept(keep[:, :, :2], 4)[0].shape == (2, 1, 4)
    with pytest.raises(ValueError, match="3 rows kept but only 2 slots"):
        pack_kept(keep, 2)


def test_newest_mask_shortcut_and_its_fallback():
    """Consecutive newest positions take the shortcut; a gap among the k newest must fall back to the exact
    top-k, in any slot order, with free slots (-1) ignored."""
    from flexgen_h2o.kv.select import newest_mask
    pos = torch.tensor([[[7, -1, 3, 9, 8, 0]],          # newest 3 consecutive: 7, 8, 9
                        [[10, 5, -1, 0, 9, -1]],         # gap: newest 3 are 5, 9, 10
                        [[2, -1, -1, 1, -1, -1]]])       # fewer valid than k: all of them
    valid = pos >= 0
    got = newest_mask(pos, valid, 3)
    want = [[7, 8, 9], [5, 9, 10], [1, 2]]
    for b in range(3):
        assert sorted(pos[b, 0][got[b, 0]].tolist()) == want[b]
    assert not newest_mask(pos, valid, 0).any()
