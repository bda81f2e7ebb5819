"""The outside check of the question-aware scorers: on the same prompts (SmolLM2's real weights, fp32, two
500-token windows of Lee news) at the same budget, the prompt keys our engine's prefill keeps for `snapkv`, `snapkv`
with head-adaptive budgets and `tova` equal, per (prompt, layer, KV head), the indices kvpress 0.5.5's SnapKVPress,
AdaKVPress(SnapKVPress) and TOVAPress keep, as its own code decides them (benchmarks/systems/kvpress_keep_child.py), or differ only where two keys' scores tie within fp32
rounding at the cut (counted and printed). Runs where the kvpress virtualenv exists; skipped with the reason
otherwise.

The budgets are kvpress's: n_kept = max(1, int(L * (1 - R))) per KV head; ours is the same total with no sinks,
SnapKV's observation window as the recent share and the rest by score (EvictionConfig's defaults for both rules).
kvpress averages over the window's queries and the group's heads where we sum (the same order), pools per
attention head before averaging the group where we pool the group's sum (pooling is linear), and ranks the
window above every key as we do. Under AdaKV a layer's heads share one cut: kvpress means where we sum, by the
same divisor (window queries x group heads) for every head of a layer, so the two rank a layer's keys alike."""
from __future__ import annotations

import pytest
import torch

from flexgen_h2o.config import GenerationConfig, OffloadPolicy
from flexgen_h2o.engine import Engine
from flexgen_h2o.kv import EvictionConfig

L, R = 500, 0.8
N_KEPT = max(1, int(L * (1 - R)))        # kvpress's count, with its float rounding (99 here, not 100)
# Two fp32 programs score a key: each probability is exp of a 64-term logit, whose rounding is at most
# gamma(64) * sum|q k| (tests/tolerances.dot_bound), a few 1e-5 of SmolLM2's largest logits; relative to the
# probability that is the same absolute amount, so two keys whose kvpress scores differ by less than TIE at the
# cut may fall either way.
TIE = 1e-4
# (rule, window, kernel); "adakv": snapkv with head-adaptive budgets against AdaKVPress(SnapKVPress)
CASES = {"snapkv-64-5": ("snapkv", 64, 5), "snapkv-16-3": ("snapkv", 16, 3), "tova": ("tova", 1, 1),
         "adakv-64-5": ("adakv", 64, 5), "adakv-16-3": ("adakv", 16, 3)}
ALPHA = 0.2                  # AdaKVPress's alpha_safeguard and our default head floor


def _no_venv() -> str | None:
    from benchmarks.systems import kvpress as kvp
    if not kvp.venv_python().is_file():
        return f"no kvpress virtualenv at {kvp.venv_dir()} (benchmarks.systems.kvpress.ensure_venv makes it)"
    return None


pytestmark = pytest.mark.skipif(_no_venv() is not None, reason=str(_no_venv()))


@pytest.fixture(scope="module")
def prompts(smollm2):
    from flexgen_h2o.eval import data
    loaded, _, _ = smollm2
    stream = data.corpus_stream(loaded.tokenizer, "lee", 3 * L)
    return [stream[:L], stream[2 * L:]]


def ours_kept(loaded, prompts, ev: EvictionConfig) -> list[list[list[set[int]]]]:
    """[prompt][layer][kv head] -> positions our prefill kept."""
    engine = Engine(loaded.config, loaded.read, offload=OffloadPolicy(kv_dtype="float32", gpu_batch_size=2),
                    eviction=ev)
    try:
        engine.generate(prompts, GenerationConfig(max_new_tokens=1, stop_at_eos=False))
        per_layer: dict[int, list] = {}
        for caches in engine.last_caches:
            for layer, split in caches.items():
                for cache in split.caches:
                    per_layer.setdefault(layer, []).extend(cache.kept_positions())
    finally:
        engine.close()
    layers = [per_layer[k] for k in sorted(per_layer)]
    return [[[set(col) for col in layer[p]] for layer in layers] for p in range(len(prompts))]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_our_keep_sets_are_kvpress_s(smollm2, prompts, case):
    from benchmarks.systems import kvpress as kvp
    loaded, _, _ = smollm2
    policy, window, kernel = CASES[case]
    if policy in ("snapkv", "adakv"):
        heads = {"head_budgets": "adaptive", "head_floor": ALPHA} if policy == "adakv" else {}
        ev = EvictionConfig(policy="snapkv", kv_budget=N_KEPT, score_window=window, pool_kernel=kernel, **heads)
        press = "adakv-snapkv" if policy == "adakv" else "snapkv"
        theirs = kvp.keep_sets(prompts, press, R, window_size=window, kernel_size=kernel,
                               alpha_safeguard=ALPHA if policy == "adakv" else None)
    else:
        ev = EvictionConfig(policy="tova", kv_budget=N_KEPT)
        theirs = kvp.keep_sets(prompts, "tova", R)
    budget = ev.resolve(L, 1)
    assert (budget.sink, budget.budget, budget.recent) == (0, N_KEPT, window)
    assert theirs["n_kept"] == N_KEPT
    ours = ours_kept(loaded, prompts, ev)
    columns = ties = uneven = 0
    for p, per_layer in enumerate(ours):
        for layer, per_head in enumerate(per_layer):
            want = [set(k) for k in theirs["prompts"][p]["kept"][layer]]
            scores = torch.tensor(theirs["prompts"][p]["scores"][layer], dtype=torch.float64)      # (heads, L)
            columns += len(per_head)
            if policy == "adakv":           # one budget for the layer's heads: the cut is over all of them
                assert sum(map(len, per_head)) == sum(map(len, want)) == len(per_head) * N_KEPT
                assert min(map(len, per_head)) >= max(1, int(N_KEPT * ALPHA))
                uneven += len({len(k) for k in per_head}) > 1
                safe = theirs["prompts"][p]["safeguarded"][layer]
                ranked = scores.clone()
                for head, keys in enumerate(safe):
                    ranked[head, keys] = float("inf")
                n = len(per_head) * N_KEPT
                cuts = [ranked.flatten().sort(descending=True).values[n - 1:n + 1].mean()] * len(per_head)
            else:
                assert all(len(k) == len(w) == N_KEPT for k, w in zip(per_head, want))
                cuts = [row.sort(descending=True).values[N_KEPT - 1:N_KEPT + 1].mean() for row in scores]
            for head, (kept, cut) in enumerate(zip(per_head, cuts)):
                if kept == want[head]:
                    continue
                for key in kept ^ want[head]:          # only keys at the cut, within rounding of it
                    gap = abs(float(scores[head, key]) - float(cut)) / float(cut)
                    assert gap <= TIE, (case, p, layer, head, key, gap)
                ties += 1
    print(f"{case}: {columns - ties} of {columns} (prompt, layer, head) keep-sets equal kvpress's; {ties} differ "
          f"only at a tie within {TIE:g} of the cut" + (f"; {uneven} layers split unevenly" if uneven else ""))
    assert ties <= columns // 10
    assert policy != "adakv" or uneven > 0
