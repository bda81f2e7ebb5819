"""--compress-cache: K and V stored group-wise int4/int8 (flexgen_h2o.formats.QuantFormat) in the fixed-size H2O
cache, against the masked reference reading every earlier row as quantization gives it back (fake_quant)."""
from __future__ import annotations

import pytest
import torch

from flexgen_h2o.config import OffloadPolicy
from flexgen_h2o.formats import FP16, quant_format
from flexgen_h2o.kv import EvictionConfig
from flexgen_h2o.kv.cache import KVCache
from flexgen_h2o.models.layer import KVSpec
from flexgen_h2o.quant import GroupQuant
from tests.helpers import greedy, make_engine, max_logit_diff, random_prompts, tiny_hf
from tests.reference.fake_quant import fake_quant
from tests.quant_inputs import EngineQuantInputs, first_flipped_step, reference_inputs
from tests.reference.compare import LENGTHS, N_NEW, PLACEMENTS, SEED, all_caches, left_padded
from tests.reference.compare import quantized_reference as reference
from tests.tolerances import gamma, greedy_agreement, logit_bound

H2O = EvictionConfig(policy="h2o", hh_size=4, recent_size=3, sink_size=1)
FULL = EvictionConfig(policy="full")
ROLLING = EvictionConfig(policy="h2o", hh_size=4, recent_size=3, position_rolling=True)
ADAPTIVE = EvictionConfig(policy="h2o", hh_size=4, recent_size=3, head_budgets="adaptive")     # a ragged cache


def compressed_run(kind: str, ev: EvictionConfig, bits: int, prompts=None, **offload):
    model = tiny_hf(kind)
    prompts = prompts or random_prompts(LENGTHS, seed=SEED)
    offload_dir = offload.pop("offload_dir", None)
    policy = OffloadPolicy(**{"kv_bits": bits, "gpu_batch_size": len(prompts), **offload})
    engine = make_engine(model, eviction=ev, offload=policy, offload_dir=offload_dir)
    return model, prompts, engine, engine.generate(prompts, greedy(N_NEW))


@pytest.mark.parametrize("kind, ev, bits", [
    ("opt", H2O, 4), ("llama-gqa", H2O, 4), ("llama-mha", FULL, 4), ("llama-gqa", ROLLING, 4),
    ("opt", FULL, 8), ("llama-gqa", H2O, 8), ("llama-gqa", ADAPTIVE, 4)],
    ids=lambda x: getattr(x, "policy", x) + ("-adaptive" if getattr(x, "head_budgets", "") == "adaptive" else "")
    if not isinstance(x, (int, str)) else x)
def test_compressed_cache_matches_the_reference_of_the_same_quantized_math(kind, ev, bits, monkeypatch):
    spy = EngineQuantInputs(monkeypatch)
    model, prompts, engine, out = compressed_run(kind, ev, bits)
    monkeypatch.undo()
    try:
        quant_log: dict = {}
        tokens, logits = reference(model, prompts, ev, (bits, 64), quant_log=quant_log)
        mask = left_padded(model, prompts)[1]
        lengths = [len(p) for p in prompts]
        # the codes both runs store, from each one's own quantizer inputs: equal up to `first` (each flip is
        # asserted a near tie there), so the two read the same rounded history before it, on any CPU
        first, delta = first_flipped_step(spy.by_layer(engine), reference_inputs(quant_log, mask), lengths, bits,
                                          N_NEW)
        # the inputs differ by fp32 rounding only, not a wrong scale or row: K / scale <= 1 and |V| <= 4 come
        # from fan-ins of 64 in two orders (2 gamma(64) relative each, x4 for their magnitude)
        assert delta <= 2 * gamma(64) * 4, delta
        strict = 0
        for i in range(len(prompts)):
            want = [l[i] for l in logits]
            bound = logit_bound(model, torch.stack(want))
            # before the first flipped code the same math in other fp32 orders: tokens equal but at a near tie
            # of the reference's logits, logits within the model's fp32 bound. From the flip on the two read
            # other (equally right) roundings and nothing is compared
            n = greedy_agreement(out.token_ids[i][:first[i]], tokens[i, :first[i]].tolist(), want, bound,
                                 f"sequence {i}")
            assert max_logit_diff(engine.step_logits[i][:n], want[:n]) <= bound, f"sequence {i}"
            strict += n
        # the comparison has teeth: most steps are strict (a flip needs a value within ~1e-6 of a boundary)
        assert strict >= 0.5 * N_NEW * len(prompts), first
        # the quantization is really there: the unrounded reference is farther than the bound
        _, plain = reference(model, prompts, ev, None)
        far = max(max_logit_diff(engine.step_logits[i][:first[i]], [l[i] for l in plain[:first[i]]])
                  for i in range(len(prompts)))
        assert far > 1e-3 > logit_bound(model, torch.stack(plain)), far
        caches = all_caches(engine)
        assert all(c.k.dtype == torch.uint8 and c.k.shape[-1] == c.fmt.row_width(c.spec.head_dim) for c in caches)
    finally:
        engine.close()


def assert_same_run(model, engine, prompts, tokens, logits, want_tokens, want_logits, got_inputs, want_inputs):
    """Two engine runs of the same prompts with int4 KV. With the compiled kernels on the CPU bit for bit: every
    op computes a row in one order whatever its tier, batch-mates or prefill (engine.kernels.batch_invariant;
    docs/cli.md, "What is guaranteed"). Without them K and V may differ by fp32 rounding and flip a code: the
    main test's rule, codes compared from both runs' quantizer inputs (each flip a near tie), and before each
    sequence's first flip tokens equal but at a near tie, logits within logit_bound."""
    if engine.kernels.batch_invariant and engine.device.type == "cpu":
        assert tokens == want_tokens
        assert all(torch.equal(a, b) for i in range(len(prompts)) for a, b in zip(logits[i], want_logits[i]))
        return
    first, _ = first_flipped_step(got_inputs, want_inputs, [len(p) for p in prompts], 4, N_NEW)
    for i in range(len(prompts)):
        bound = logit_bound(model, torch.stack(want_logits[i]))
        n = greedy_agreement(tokens[i][:first[i]], want_tokens[i][:first[i]], want_logits[i], bound, f"sequence {i}")
        assert max_logit_diff(logits[i][:n], want_logits[i][:n]) <= bound, f"sequence {i}"


@pytest.fixture(scope="module")
def compute_run():
    with pytest.MonkeyPatch.context() as mp:
        spy = EngineQuantInputs(mp)
        model, prompts, engine, out = compressed_run("llama-gqa", H2O, 4,
                                                     prompts=random_prompts([20, 13, 24, 9, 17, 22]))
    inputs = spy.by_layer(engine)
    engine.close()
    return model, prompts, out.token_ids, engine.step_logits, inputs


@pytest.mark.parametrize("where, ngb", [("host", 1), ("disk", 1), ("mixed", 1), ("mixed", 3)])
def test_every_tier_and_split_gives_the_compute_tier_run(compute_run, tmp_path, where, ngb, monkeypatch):
    """A host cache is read in place (the compiled kernel, or torch's blocks), a disk or split one is staged
    through the format; all of them give the compute tier's run."""
    model, prompts, want_tokens, want_logits, want_inputs = compute_run
    spy = EngineQuantInputs(monkeypatch)
    _, _, engine, out = compressed_run("llama-gqa", H2O, 4, prompts=prompts, gpu_batch_size=len(prompts) // ngb,
                                       num_gpu_batches=ngb, offload_dir=tmp_path, **PLACEMENTS[where])
    try:
        kinds = {c.tier_kind for c in all_caches(engine)}
        assert kinds == ({"compute", "host", "disk"} if (where, ngb) == ("mixed", 1) else
                         {"compute", "host"} if where == "mixed" else {where})
        assert_same_run(model, engine, prompts, out.token_ids, engine.step_logits, want_tokens, want_logits,
                        spy.by_layer(engine), want_inputs)
    finally:
        engine.close()


def test_prefilled_runs_reuse_the_stored_rows_without_quantizing_twice(monkeypatch):
    """Engine.prefill keeps the compressed rows; a run from them equals the run from scratch."""
    model = tiny_hf("llama-gqa")
    prompts = random_prompts(LENGTHS)
    spy = EngineQuantInputs(monkeypatch)
    engine = make_engine(model, offload=OffloadPolicy(kv_bits=4, gpu_batch_size=len(prompts)))
    try:
        direct = engine.generate(prompts, greedy(N_NEW), eviction=H2O)
        want = {i: list(engine.step_logits[i]) for i in range(len(prompts))}
        want_inputs, spy.rows = spy.by_layer(engine), {}          # the next run's caches alone from here
        prefilled = engine.prefill(prompts)
        got_inputs, spy.rows = spy.by_layer(engine), {}           # the prompt rows, quantized by the prefill
        engine.step_logits = {}
        again = engine.generate(prompts, greedy(N_NEW), eviction=H2O, prefilled=prefilled)
        for layer, rows in spy.by_layer(engine).items():          # and the decode steps' rows
            got_inputs.setdefault(layer, {}).update(rows)
        assert_same_run(model, engine, prompts, again.token_ids, engine.step_logits, direct.token_ids, want,
                        got_inputs, want_inputs)
    finally:
        engine.close()


def test_the_cache_stores_committed_rows_quantized_and_evicts_in_place():
    spec, fmt = KVSpec(2, 64), quant_format(4)
    from flexgen_h2o.kv import get_policy
    ev = EvictionConfig(policy="h2o", hh_size=2, recent_size=2)
    budget = ev.resolve(6, 4)
    cache = KVCache(spec, 3, budget.capacity, get_policy("h2o"), budget, fmt=fmt)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, 2, 6, 64, generator=g), torch.randn(3, 2, 6, 64, generator=g)
    scores = torch.rand(3, 2, 6, generator=g)
    cache.commit_prefill(k, v, scores, torch.arange(6).expand(3, 6))
    slots = 3 * 2 * budget.capacity
    assert cache.k.shape == (3, 2, budget.capacity, 36) and cache.nbytes == slots * (2 * 36 + 8) + 3 * 2 * 64 * 4
    view = cache.stage(torch.device("cpu"), torch.float32)
    kept = cache.pos[:, :, :view.k.shape[2]]
    scale = k.abs().amax(dim=2)                          # (b, g, d): each channel's largest |k| in the prompt
    torch.testing.assert_close(cache.k_scale[:, :, 0], scale, rtol=0, atol=0)
    for b in range(3):
        for h in range(2):
            for slot, p in enumerate(kept[b, h].tolist()):
                if p >= 0:
                    want_k = fake_quant(k[b, h, p] / scale[b, h], 4, 64) * scale[b, h]
                    torch.testing.assert_close(view.k[b, h, slot], want_k, rtol=0, atol=0)
                    torch.testing.assert_close(view.v[b, h, slot], fake_quant(v[b, h, p], 4, 64), rtol=0, atol=0)
    assert GroupQuant(4, 64).row_bytes(64) == 36


def test_kv_bytes_per_token_meet_the_compression_targets():
    """K/V bytes per token and head: 4-bit <= 0.30x fp16, 8-bit <= 0.55x, the fp16 minimum and step included;
    with H2O's fp32 score and int32 position per slot beside them the ratio is said in docs/compression.md."""
    for head_dim in (64, 128):
        plain = 2 * FP16.nbytes(head_dim)
        assert 2 * quant_format(4).nbytes(head_dim, head_dim) / plain <= 0.30
        assert 2 * quant_format(8).nbytes(head_dim, head_dim) / plain <= 0.55
