"""Continuous refill (schedule/refill.py): a refilled job gives every prompt what it gets alone, whichever row it
took, what it shared the block with and when it joined; for every eviction rule and budget kind, on every tier,
with per-prompt max_new_tokens, EOS, stop strings and sampling. The CLI's SIGKILL-and-resume case is in
tests/test_refill_cli.py.

With the compiled kernels every row is computed in one order whatever its batch-mates, row or join time, so a
prompt's tokens and logits are its alone run's bit for bit; without them (torch ops) fp32 KV is held to
tests/test_h2o_engine.assert_agree's derived rule (tokens part only at a near tie, logits within logit_bound)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from flexgen_h2o.config import GenerationConfig, OffloadPolicy
from flexgen_h2o.engine import Engine
from flexgen_h2o.kv import EvictionConfig
from flexgen_h2o.kv.page_rule import PageRule
from tests.helpers import greedy, make_engine, random_prompts, tiny_hf, weight_reader
from tests.helpers import assert_agree
from tests.reference.compare import PLACEMENTS

LENS = [5, 31, 12, 24, 9, 18, 7, 27, 14, 20]
MAX_NEW = [3, 22, 11, 1, 16, 9, 24, 5, 13, 2]         # per prompt: rows free at different steps, one at its join
POLICIES = {
    "full": EvictionConfig(policy="full"),
    "h2o-ratio": EvictionConfig(policy="h2o", hh_ratio=0.2),
    "h2o-sizes-sink": EvictionConfig(policy="h2o", hh_size=6, recent_size=4, sink_size=1),
    "h2o-kv-budget": EvictionConfig(policy="h2o", kv_budget=12),
    "port-ratio": EvictionConfig(policy="h2o-port", hh_ratio=0.2),
    "random-ratio": EvictionConfig(policy="random", hh_ratio=0.2, seed=3),
    "rolling-ratio": EvictionConfig(policy="h2o", hh_ratio=0.2, position_rolling=True),
    "snapkv-ratio": EvictionConfig(policy="snapkv", hh_ratio=0.2, score_window=4, pool_kernel=3),
    "tova-ratio": EvictionConfig(policy="tova", hh_ratio=0.2),
    "snapkv-adaptive": EvictionConfig(policy="snapkv", hh_ratio=0.2, score_window=4, pool_kernel=3,
                                      head_budgets="adaptive"),
    "pages": EvictionConfig(pages=PageRule(page_size=4, fetch_pages=3)),
    "pages-ahead": EvictionConfig(pages=PageRule(page_size=4, fetch_pages=3, ahead=True)),
}
# name -> (GPU batch size, GPU batches, placement, refill share)
CUTS = {
    "2x2": (2, 2, {}, 0.0),
    "3x1-mixed-tiers": (3, 1, PLACEMENTS["mixed"], 0.0),
    "4x1-half-free": (4, 1, {}, 0.5),
}
CASES = [(kind, policy) for kind in ("llama-gqa", "opt") for policy in POLICIES
         if not (POLICIES[policy].position_rolling and kind == "opt")]


def refilled(engine: Engine, prompts, gen: GenerationConfig, max_new, ev=None, share=None, seeds=None):
    """{prompt: (tokens, finish reason, text)} of a refilled job, and the order the prompts finished in."""
    got, order = {}, []
    for done in engine.generate_refill(prompts, gen, max_new_tokens=max_new, eviction=ev, share=share, seeds=seeds):
        for f in done:
            assert f.index not in got, f"prompt {f.index} handed out twice"
            got[f.index] = (f.token_ids, f.finish_reason, f.text)
            order.append(f.index)
    return got, order


def assert_as_alone(model, engine, tokens_alone, logits_alone, tokens, logits, bitwise: bool = True) -> None:
    """One prompt refilled against its alone run: bit for bit with the compiled kernels (batch_invariant), else
    assert_agree's fp32 rule."""
    assert_agree(model, [tokens], [logits], [tokens_alone], [logits_alone],
                 bitwise and engine.kernels.batch_invariant)


@pytest.fixture(scope="module")
def alone_for():
    """(kind, policy) -> per prompt (tokens, step logits), each prompt run alone in synchronous blocks."""
    made: dict = {}

    def get(kind: str, policy: str):
        if (kind, policy) not in made:
            model = tiny_hf(kind)
            one = make_engine(model, offload=OffloadPolicy(kv_dtype="float32", gpu_batch_size=1))
            prompts = random_prompts(LENS)
            out = []
            for i, p in enumerate(prompts):
                one.step_logits = {}
                res = one.generate([p], greedy(MAX_NEW[i]), eviction=POLICIES[policy])
                out.append((res.token_ids[0], one.step_logits[0]))
            one.close()
            made[(kind, policy)] = (model, prompts, out)
        return made[(kind, policy)]
    return get


@pytest.mark.parametrize("cut", list(CUTS))
@pytest.mark.parametrize("kind,policy", CASES)
def test_refilled_job_equals_each_prompt_alone(alone_for, tmp_path, kind, policy, cut):
    model, prompts, alone = alone_for(kind, policy)
    gbs, ngb, placement, share = CUTS[cut]
    engine = make_engine(model, offload=OffloadPolicy(kv_dtype="float32", gpu_batch_size=gbs, num_gpu_batches=ngb,
                                                      **placement), offload_dir=tmp_path)
    try:
        got, order = refilled(engine, prompts, greedy(max(MAX_NEW)), MAX_NEW, POLICIES[policy], share)
        m = engine.last_refill_metrics
    finally:
        engine.close()
    assert sorted(got) == list(range(len(prompts)))
    for i, (tokens, logits) in enumerate(alone):
        assert len(got[i][0]) == MAX_NEW[i] and got[i][1] == "length"
        # bit for bit with the compiled kernels, for fixed sizes too: a prompt whose budget keeps its whole run
        # attends as the full cache does beside evicting prompts, as it does alone (StepContext.score_rows)
        assert_as_alone(model, engine, tokens, logits, got[i][0], engine.step_logits[i])
    # rows really were refilled: more joins than the first, prompts finished out of input order
    assert m["joins"] >= (3 if share == 0.0 else 2) and order != sorted(order)
    assert m["generated_tokens"] == sum(MAX_NEW) and 0 < m["busy_row_steps"] <= m["row_steps"]


def _engine(model, eos_id=None, **offload) -> Engine:
    cfg, read = weight_reader(model)
    engine = Engine(replace(cfg, eos_id=eos_id), read, offload=OffloadPolicy(kv_dtype="float32", **offload),
                    device="cpu", decode=lambda ids: "".join(f"<{t}>" for t in ids))
    engine.step_logits = {}
    engine.on_step_logits = lambda t, seqs, logits: [engine.step_logits.setdefault(s, []).append(logits[r].clone())
                                                     for r, s in enumerate(seqs)]
    return engine


def test_eos_stop_strings_and_max_new_as_alone():
    """Stops end a row where they end the prompt alone; its row takes the next prompt."""
    model = tiny_hf("llama-gqa")
    prompts = random_prompts(LENS)
    free = _engine(model, gpu_batch_size=1)
    runs = [free.generate([p], greedy(24)).token_ids[0] for p in prompts]
    eos = runs[1][4]                                 # a token prompt 1 generates at its 5th step
    stop_tok = runs[2][6]
    gen = GenerationConfig(max_new_tokens=24, stop_at_eos=True, stop=(f"<{stop_tok}>",))
    alone_engine = _engine(model, eos_id=eos, gpu_batch_size=1)
    alone = [alone_engine.generate([p], gen, max_new_tokens=[MAX_NEW[i]]) for i, p in enumerate(prompts)]
    engine = _engine(model, eos_id=eos, gpu_batch_size=3)
    got, _ = refilled(engine, prompts, gen, MAX_NEW)
    reasons = {got[i][1] for i in got}
    assert {"eos", "stop", "length"} <= reasons, reasons
    for i, res in enumerate(alone):
        assert got[i] == (res.token_ids[0], res.finish_reasons[0], res.texts[0]), f"prompt {i}"
    assert got[1][1] in ("eos", "stop") and len(got[1][0]) <= 5


def test_sampling_is_seeded_per_prompt():
    """Temperature sampling: each prompt draws from its own generator, keyed by its seed, wherever it runs."""
    model = tiny_hf("opt")
    prompts = random_prompts(LENS)
    gen = GenerationConfig(max_new_tokens=24, temperature=0.9, top_k=20, seed=7, stop_at_eos=False)
    max_new = [24, 3, 11, 1, 16, 9, 5, 5, 13, 2]      # prompt 0 runs beside free rows at the end
    one = _engine(model, gpu_batch_size=1)
    alone = [one.generate([p], gen, max_new_tokens=[max_new[i]], seeds=[100 + i]).token_ids[0]
             for i, p in enumerate(prompts)]
    engine = _engine(model, gpu_batch_size=2, num_gpu_batches=2)
    got, _ = refilled(engine, prompts, gen, max_new, seeds=[100 + i for i in range(len(prompts))])
    assert [got[i][0] for i in range(len(prompts))] == alone
    assert len({tuple(t) for t in alone}) == len(prompts)


def test_compressed_cache_and_disk_activations(tmp_path):
    """int4 KV (its per-channel key scale reset with the row) and hidden states resting on disk between the
    layers of a join pass and of the decode steps; weights streamed from disk (a quarter-share rule)."""
    model = tiny_hf("llama-gqa")
    prompts = random_prompts(LENS)
    ev = EvictionConfig(policy="h2o", hh_ratio=0.2)
    one = make_engine(model, offload=OffloadPolicy(gpu_batch_size=1, kv_bits=4))
    alone = []
    for i, p in enumerate(prompts):
        one.step_logits = {}
        alone.append((one.generate([p], greedy(MAX_NEW[i]), eviction=ev).token_ids[0], one.step_logits[0]))
    offload = OffloadPolicy.from_percent((0, 50, 0, 50, 0, 0), gpu_batch_size=2, num_gpu_batches=2, kv_bits=4)
    engine = make_engine(model, offload=offload, offload_dir=tmp_path)
    try:
        got, _ = refilled(engine, prompts, greedy(24), MAX_NEW, ev)
        assert engine.last_refill_metrics["joins"] >= 2
    finally:
        engine.close()
    # int4 KV: bit for bit with the compiled kernels. Without them the GEMMs' batch shape moves K and V by fp32
    # rounding, which may flip an int4 code at any margin (test_compressed_kv follows such flips code by code);
    # here only the lengths are checked then
    for i, (tokens, logits) in enumerate(alone):
        if engine.kernels.batch_invariant:
            assert_as_alone(model, engine, tokens, logits, got[i][0], engine.step_logits[i])
        else:
            assert len(got[i][0]) == len(tokens)
    assert not any(p.is_file() for p in tmp_path.rglob("*"))            # the offload files are gone


def test_a_row_refilled_keeps_nothing_of_its_last_prompt():
    """After a join, the row's slots hold the new prompt's positions only, with its own budget."""
    model = tiny_hf("llama-gqa")
    prompts = random_prompts([30, 6])
    ev = EvictionConfig(policy="h2o", hh_ratio=0.2)
    engine = make_engine(model, offload=OffloadPolicy(kv_dtype="float32", gpu_batch_size=1))
    refilled(engine, prompts, greedy(8), [8, 1], ev)
    for split in engine.last_caches[0].values():
        cache = split.caches[0]
        assert cache.budget.rows[0] == ev.resolve(6, 1)
        assert all(max(col) <= 5 for col in cache.kept_positions()[0])
        assert cache.k_scale is None and int((cache.pos[0] >= 0).sum(-1).max()) <= 2


def test_refill_checks_its_input():
    engine = make_engine(tiny_hf("opt"))
    with pytest.raises(Exception, match="empty prompt"):
        list(engine.generate_refill([[3, 4], []], greedy(2)))
    with pytest.raises(Exception, match="context window"):
        list(engine.generate_refill([[3] * 10], greedy(engine.model.max_seq_len)))


def test_idle_gpu_batches_sit_out_and_joins_fill_busy_batches_first():
    """At the tail a GPU batch with no prompt left is not computed; a join goes to the busiest batch."""
    model = tiny_hf("opt")
    prompts = random_prompts([9, 12, 7, 15, 10])
    max_new = [1, 1, 1, 20, 6]
    alone = [make_engine(model, offload=OffloadPolicy(kv_dtype="float32", gpu_batch_size=1))
             .generate([p], greedy(n)).token_ids[0] for p, n in zip(prompts, max_new)]
    engine = make_engine(model, offload=OffloadPolicy(kv_dtype="float32", gpu_batch_size=2, num_gpu_batches=2))
    got, order = refilled(engine, prompts, greedy(20), max_new)
    m = engine.last_refill_metrics
    assert [got[i][0] for i in range(len(prompts))] == alone
    # prompts 0-3 join batches 0 and 1; 0-2 end at their join, so prompt 4 joins batch 1 (busy with prompt 3), and
    # batch 0 computes no decode step at all
    assert order[:3] == [0, 1, 2] and m["decode_steps"] == 19
    assert m["row_steps"] == 2 * m["decode_steps"] and m["busy_row_steps"] == 19 + 5


def test_free_rows_skip_the_linear_layers(monkeypatch):
    """A decode step computes the projections, MLP and head over the rows holding a prompt only: once one of three
    rows is free for good (nothing left to join), every linear layer sees two rows, and the tokens are unchanged."""
    model = tiny_hf("llama-gqa")
    prompts = random_prompts([9, 12, 7])
    max_new = [2, 12, 12]
    alone = [make_engine(model, offload=OffloadPolicy(kv_dtype="float32", gpu_batch_size=1))
             .generate([p], greedy(n)).token_ids[0] for p, n in zip(prompts, max_new)]
    engine = make_engine(model, offload=OffloadPolicy(kv_dtype="float32", gpu_batch_size=3))
    seen: list[tuple[int, int]] = []
    real = engine.kernels.linear
    monkeypatch.setattr(engine.kernels, "linear", lambda x, w, b=None: seen.append(x.shape[:2]) or real(x, w, b))
    got, _ = refilled(engine, prompts, greedy(12), max_new)
    assert [got[i][0] for i in range(len(prompts))] == alone
    decode = [rows for rows, tokens in seen if tokens == 1]      # (rows, tokens): a decode step has one token
    # the join's three one-prompt groups (their heads), decode steps of 3 rows until prompt 0 ends, then of 2
    k, m = decode.count(3), decode.count(2)
    assert decode == [1] * 3 + [3] * k + [2] * m and m > 5 * k > 0, decode


def test_join_groups_pad_little():
    from flexgen_h2o.schedule.refill import JOIN_PADDING, _similar_lengths
    items = [(n, r, r) for r, n in enumerate([10, 10, 11, 30, 31, 100])]
    groups = _similar_lengths(items)
    assert [[x[0] for x in g] for g in groups] == [[10, 10, 11], [30, 31], [100]]
    for g in groups:
        longest = max(x[0] for x in g)
        assert longest * len(g) - sum(x[0] for x in g) <= JOIN_PADDING * longest * len(g)


def test_a_chunked_prompt_pass_takes_its_own_rows_budgets():
    """Synchronous blocks too: a prompt pass cut into one-sequence chunks (--prefill-batch-size 1) selects each
    chunk against its own rows' budgets and random keys (it used to hand the whole batch's to the policy)."""
    model = tiny_hf("llama-gqa")
    prompts = random_prompts([25, 8, 17])
    for ev in (EvictionConfig(policy="h2o", hh_ratio=0.2), EvictionConfig(policy="random", hh_ratio=0.2, seed=1)):
        one = make_engine(model, offload=OffloadPolicy(kv_dtype="float32", gpu_batch_size=1))
        alone = [one.generate([p], greedy(6), eviction=ev).token_ids[0] for p in prompts]
        chunked = make_engine(model, offload=OffloadPolicy(kv_dtype="float32", gpu_batch_size=3,
                                                           prefill_batch_size=1))
        assert chunked.generate(prompts, greedy(6), eviction=ev).token_ids == alone
