"""kvpress_keep_child.py (which keys kvpress's SnapKV, TOVA and AdaKV(SnapKV) keep at prefill) through
kvpress.keep_sets: structural facts of each press's keep sets on SmolLM2, 2 prompts of 200 tokens. The child
runs in the kvpress virtualenv (slow: ~12-17 s a press on 2 cores); the argument checks run without it."""
from __future__ import annotations

import argparse
import importlib.util
import random

import pytest

from benchmarks.systems import kvpress as kvp

L, R, W, K = 200, 0.5, 16, 5        # W < n_safe = int(100 * 0.2) = 20, so AdaKV's safeguard reaches the prefix
N_KEPT = int(L * (1 - R))


def load_child():
    spec = importlib.util.spec_from_file_location("kvpress_keep_child_under_test", kvp.KEEP_CHILD)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_unknown_press_is_refused():
    with pytest.raises(ValueError, match="snapkv"):
        kvp.keep_sets([[1, 2, 3]], "h2o", 0.5)


def test_child_parser_and_argument_checks():
    child = load_child()
    p = child.make_parser()
    a = p.parse_args(["--store", "s", "--ids", "i", "--json", "j", "--press", "adakv-snapkv",
                      "--compression-ratio", "0.5"])
    assert (a.window_size, a.kernel_size, a.alpha_safeguard, a.attn) == (64, 5, None, "sdpa")
    child.check_args(a, 65)
    for over, prompt_len in (({"window_size": 64}, 64), ({"kernel_size": 4}, 200), ({"attn": "eager"}, 200),
                             ({"compression_ratio": 0.0}, 200), ({"alpha_safeguard": 1.5}, 200)):
        with pytest.raises(SystemExit):
            child.check_args(argparse.Namespace(**{**vars(a), **over}), prompt_len)
    tova = p.parse_args(["--store", "s", "--ids", "i", "--json", "j", "--press", "tova", "--compression-ratio", "0.5"])
    child.check_args(tova, 10)            # no window: any length, the window's settings unused


@pytest.fixture(scope="module")
def keep():
    from flexgen_h2o.weights import default_store_path
    store = default_store_path("smollm2-135m")
    if not kvp.venv_python().is_file():
        pytest.skip(f"no kvpress virtualenv at {kvp.venv_dir()} (benchmarks.systems.kvpress.ensure_venv makes it)")
    if not (store / "manifest.json").is_file():
        pytest.skip("no converted smollm2-135m store: run `make run` once")
    rng = random.Random(0)
    ids = [[rng.randrange(49152) for _ in range(L)] for _ in range(2)]
    cache: dict[str, dict] = {}

    def get(press: str) -> dict:
        if press not in cache:
            cache[press] = kvp.keep_sets(ids, press, R, window_size=W, kernel_size=K, store=store)
        return cache[press]
    return get


def heads(raw: dict):
    """(prompt, layer, kept per head, scores per head, the layer's record) for every prompt and layer."""
    assert raw["n_prompts"] == len(raw["prompts"]) == 2 and raw["prompt_len"] == L
    assert raw["n_kept"] == N_KEPT and raw["versions"]["kvpress"] == "0.5.5" and raw["dtype"] == "torch.float32"
    for p, pr in enumerate(raw["prompts"]):
        assert len(pr["kept"]) == len(pr["scores"]) == raw["n_layers"] == 30
        for li, (kept, scores) in enumerate(zip(pr["kept"], pr["scores"])):
            assert len(kept) == len(scores) == raw["n_kv_heads"] == 3
            for k, s in zip(kept, scores):
                assert k == sorted(set(k)) and all(0 <= i < L for i in k) and len(s) == L
            yield p, li, kept, scores, pr


def ranked_by(kept: list[int], scores: list[float]) -> bool:
    """Every kept key scores at least as high as every dropped one."""
    dropped = set(range(L)) - set(kept)
    return not dropped or min(scores[i] for i in kept) >= max(scores[i] for i in dropped)


@pytest.mark.slow
def test_snapkv_keeps_n_kept_per_head_and_the_window(keep):
    raw = keep("snapkv")
    assert raw["settings"] == {"press": "snapkv", "kvpress_class": "SnapKVPress", "compression_ratio": R,
                               "window_size": W, "kernel_size": K}
    per_head_sets = set()
    for _, _, kept, scores, _ in heads(raw):
        for k, s in zip(kept, scores):
            assert len(k) == N_KEPT and set(range(L - W, L)) <= set(k) and ranked_by(k, s)
            assert len(set(s[L - W:])) == 1 and s[L - W] > max(s[:L - W])      # the window padded above the max
            per_head_sets.add(tuple(k))
    assert len(per_head_sets) > 1                 # heads choose differently (not a positional rule)


@pytest.mark.slow
def test_tova_keeps_the_last_key_and_one_set_per_layer(keep):
    raw = keep("tova")
    assert raw["settings"]["kvpress_class"] == "TOVAPress" and "window_size" not in raw["settings"]
    for _, _, kept, scores, _ in heads(raw):
        assert all(len(k) == N_KEPT and L - 1 in k for k in kept)
        assert kept[0] == kept[1] == kept[2] and scores[0] == scores[1] == scores[2]
        assert ranked_by(kept[0], scores[0])


@pytest.mark.slow
def test_adakv_spreads_the_layer_budget_over_heads_above_the_safeguard(keep):
    raw = keep("adakv-snapkv")
    alpha = raw["settings"]["alpha_safeguard"]
    assert alpha == 0.2 and raw["settings"]["kvpress_class"] == "AdaKVPress"
    n_safe = max(1, int(N_KEPT * alpha))
    uneven = 0
    for p, li, kept, scores, pr in heads(raw):
        assert sum(len(k) for k in kept) == 3 * N_KEPT
        uneven += len({len(k) for k in kept}) > 1
        safe = pr["safeguarded"][li]
        pooled = []                                    # the layer's scores as AdaKV ranked them, over all heads
        for k, s, sg in zip(kept, scores, safe):
            assert len(k) >= n_safe and len(sg) == n_safe and set(sg) <= set(k)
            assert set(range(L - W, L)) <= set(sg)     # window keys rank first, so the safeguard takes them first
            ranked = [float("inf") if i in sg else v for i, v in enumerate(s)]
            pooled += [(v, i in k) for i, v in enumerate(ranked)]
        assert min(v for v, k in pooled if k) >= max(v for v, k in pooled if not k)
    assert uneven > 0                                  # some layer splits its budget unevenly


@pytest.mark.slow
def test_failure_reports_the_child_stderr(tmp_path, keep):
    keep("tova")                                       # skips with the fixture's reason where there is no venv
    with pytest.raises(RuntimeError, match="prompts of one length"):
        kvp.keep_sets([[1] * 80, [1] * 81], "snapkv", R, window_size=W, kernel_size=K)
