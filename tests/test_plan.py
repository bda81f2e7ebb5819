"""One block's Plan (planner/plan.py): the engine allocates what the plan says, and the planner's plan for the
same shape is the engine's where the prompts are equally long."""
from __future__ import annotations

from flexgen_h2o.config import OffloadPolicy
from flexgen_h2o.kv import EvictionConfig
from flexgen_h2o.models import PRESETS
from flexgen_h2o.planner import estimate
from tests.helpers import greedy, make_engine, random_prompts, tiny_hf


def test_the_engine_allocates_its_plan_and_the_planner_counts_the_same(tmp_path):
    offload = OffloadPolicy.from_percent([100, 0, 50, 0, 50, 0], gpu_batch_size=3, num_gpu_batches=2)
    ev = EvictionConfig(policy="h2o", hh_size=3, recent_size=2)
    engine = make_engine(tiny_hf("llama-gqa"), offload=offload, eviction=ev, offload_dir=tmp_path, record=False)
    engine.generate(random_prompts([9, 9, 9, 9, 9]), greedy(4))
    plan = engine.last_plan
    assert [(b.lo, b.hi, b.cache) for b in plan.batches] == [(0, 3, ((0, 2, "compute"), (2, 3, "disk"))),
                                                             (3, 5, ((0, 1, "compute"), (1, 2, "disk")))]
    for batch, caches in zip(plan.batches, engine.last_caches):
        for split in caches.values():
            assert [(lo, hi, c.tier_kind, c.capacity) for lo, hi, c in split.parts] == [
                (lo, hi, tier, plan.capacity) for lo, hi, tier in batch.cache]
    assert plan.capacity == 3 + 2 + 1 and plan.policy == "h2o" and plan.needs_scores
    assert engine.tiers["disk"].peak_bytes == plan.disk_bytes() > 0
    engine.close()
    est = estimate(engine.model, offload, ev, prompt_len=9, gen_len=4, n_seqs=5)
    assert est.plan.batches == plan.batches and est.plan.capacity == plan.capacity
    assert est.bytes["disk"]["kv"] + est.bytes["disk"]["activations"] == plan.disk_bytes()
    assert est.plan.describe().startswith("plan: 2 GPU batch(es) of 3/2 | KV 6 slots/seq x 2 layers, fp16")


def test_a_budget_that_holds_the_run_plans_the_full_rule():
    """As the engine runs it: nothing would be evicted, so the full cache's rule, with no scored attention."""
    holds_all = EvictionConfig(policy="h2o", hh_size=50, recent_size=50)
    est = estimate(PRESETS["opt-125m"], OffloadPolicy(gpu_batch_size=2), holds_all, prompt_len=9, gen_len=4)
    assert est.plan.policy == "full" and not est.plan.needs_scores and est.plan.score_block == 0
    evicting = estimate(PRESETS["opt-125m"], OffloadPolicy(gpu_batch_size=2), EvictionConfig(policy="h2o", hh_size=2,
                        recent_size=2), prompt_len=9, gen_len=4)
    assert evicting.plan.policy == "h2o" and evicting.plan.score_block > 0


def test_a_job_is_planned_once_and_handed_down(monkeypatch):
    """planner/job.plan_job checks the prompts, resolves every budget and plans every block; the engine's blocks
    and a refilled run allocate from those plans and join with those budgets, resolving nothing again."""
    ev = EvictionConfig(policy="h2o", hh_ratio=0.3)
    engine = make_engine(tiny_hf("llama-gqa"), offload=OffloadPolicy(gpu_batch_size=2, num_gpu_batches=1),
                         eviction=ev, record=False)
    prompts = random_prompts([12, 5, 9, 20, 7])
    max_new = [3, 5, 4, 2, 6]
    blocks, refill = engine.plan(prompts, max_new, bucket=True), engine.plan(prompts, max_new, refill=True)
    assert blocks.blocks == ((3, 0), (2, 4), (1,))            # longest first
    assert [b.budget for b in blocks.budgets] == [ev.resolve(len(p), g).budget for p, g in zip(prompts, max_new)]
    assert refill.blocks == ((0, 1, 2, 3, 4),) and refill.plans[0].n_seqs == 2
    want = {}
    for k, block in enumerate(blocks.blocks):
        out = engine.generate_block(blocks, k, [prompts[i] for i in block], greedy(6), list(block))
        want.update(zip(block, out[0]))

    def resolved_again(*a, **kw):
        raise AssertionError("a budget was resolved after the job was planned")
    monkeypatch.setattr(EvictionConfig, "resolve", resolved_again)
    monkeypatch.setattr(EvictionConfig, "resolve_rows", resolved_again)
    for k, block in enumerate(blocks.blocks):
        out = engine.generate_block(blocks, k, [prompts[i] for i in block], greedy(6), list(block))
        assert engine.last_plan is blocks.plans[k]
        assert dict(zip(block, out[0])) == {i: want[i] for i in block}
    got = {f.index: f.token_ids for done in engine.generate_refill(prompts, greedy(6), max_new, job=refill)
           for f in done}
    assert engine.last_plan is refill.plans[0] and got == want     # batch invariance: any row, any join
    engine.close()
