"""Length bucketing, context checks and the block loop shared by the API and the CLI's batch mode."""
from __future__ import annotations

import random

import pytest

from flexgen_h2o.config import ConfigError, GenerationConfig, OffloadPolicy
from flexgen_h2o.planner.job import check_context, padding_tokens, plan_blocks
from flexgen_h2o.schedule.blocks import run_blocks
from tests.helpers import make_engine, random_prompts, tiny_hf


def test_bucketing_cuts_padding():
    rng = random.Random(0)
    lens = [rng.choice([5, 9, 40, 120, 300]) + rng.randrange(3) for _ in range(64)]
    plain = plan_blocks(lens, 8, bucket=False)
    bucketed = plan_blocks(lens, 8)
    assert sorted(i for b in bucketed for i in b) == list(range(64))          # every prompt once
    assert all(len(b) == 8 for b in bucketed)
    assert padding_tokens(bucketed, lens) < padding_tokens(plain, lens) / 5
    assert padding_tokens(plain, lens) > 0
    # sorted, longest first: each block's prompts are at least as long as the next block's
    assert all(min(lens[i] for i in a) >= max(lens[i] for i in b) for a, b in zip(bucketed, bucketed[1:]))


def test_bucketing_groups_equal_lengths_by_budget():
    lens, max_new = [10] * 6, [1, 50, 1, 50, 1, 50]
    blocks = plan_blocks(lens, 3, max_new)
    assert [sorted(max_new[i] for i in b) for b in blocks] == [[50, 50, 50], [1, 1, 1]]


def test_padding_tokens_counts_left_padding():
    assert padding_tokens([[0, 1], [2]], [3, 5, 4]) == 2


def test_check_context_names_the_prompt():
    check_context(100, False, [60, 40], [40, 60], lambda i: f"line {i + 1}")
    with pytest.raises(ConfigError, match=r"line 2: prompt \(41 tokens\) \+ max_new_tokens \(60\) exceed the "
                                          r"context window \(100\)"):
        check_context(100, False, [60, 41], [40, 60], lambda i: f"line {i + 1}")
    check_context(100, True, [60, 41], [40, 60], lambda i: "x")                # rolling runs past it
    with pytest.raises(ConfigError, match="empty"):
        check_context(100, False, [0], [1], lambda i: "x")


def test_run_blocks_yields_each_block_with_callers_indices():
    engine = make_engine(tiny_hf("llama"), offload=OffloadPolicy(kv_dtype="float32", gpu_batch_size=2),
                         record=False)
    prompts = random_prompts([3, 12, 7, 12, 5])
    max_new = [2, 4, 3, 1, 4]
    blocks = plan_blocks([len(p) for p in prompts], 2, max_new)
    job = engine.plan(prompts, max_new, bucket=True)
    seen = list(run_blocks(engine, prompts, GenerationConfig(max_new_tokens=4, stop_at_eos=False), job))
    assert [r.indices for r in seen] == blocks == [list(b) for b in job.blocks] == [[1, 3], [2, 4], [0]]
    for r in seen:
        assert [len(t) for t in r.token_ids] == [max_new[i] for i in r.indices]
        assert r.metrics["padded_prompt_len"] == max(len(prompts[i]) for i in r.indices)
    # the same prompt alone gives the same tokens: the block results are mapped to the right indices
    alone = engine.generate([prompts[2]], GenerationConfig(max_new_tokens=3, stop_at_eos=False))
    assert seen[1].token_ids[0] == alone.token_ids[0]
    assert engine.on_step_logits is None                                       # hook removed afterwards
