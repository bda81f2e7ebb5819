"""Placement never changes a result: every OffloadPolicy gives the all-compute run's greedy tokens and logits
(bit for bit: storage dtypes match) and transformers' tokens. Plus OffloadPolicy validation."""
from __future__ import annotations

import functools
import os
import shutil

import pytest
import torch

from flexgen_h2o.config import ConfigError, OffloadPolicy
from flexgen_h2o.memory import DiskSpaceError
from tests.tolerances import greedy_agreement, logit_bound
from tests.helpers import SAME_RUN_TOL, greedy, hf_greedy, make_engine, max_logit_diff, random_prompts, tiny_hf

LENGTHS = [3, 9, 5, 12, 7, 4, 10]      # 7 prompts: blocks and GPU batches of different sizes and paddings
N_NEW = 8
PROMPTS = random_prompts(LENGTHS, seed=3)

COMPUTE, HOST, DISK = [100, 0, 100, 0, 100, 0], [0, 100, 0, 100, 0, 100], [0, 0, 0, 0, 0, 0]
MIXED = [30, 40, 20, 30, 34, 33]       # with 3-sequence batches: KV and activations on all three tiers
MIXED2 = [50, 20, 0, 60, 0, 50]

# (kind, percent, gpu_batch_size, num_gpu_batches, overlap, cpu_cache_compute, pin_weight, sep_layer)
CASES = [
    ("opt", COMPUTE, 2, 1, True, False, True, True),
    ("opt", COMPUTE, 2, 4, True, False, True, False),
    ("opt", HOST, 2, 2, True, False, True, True),
    ("opt", HOST, 2, 3, False, True, False, True),
    ("opt", DISK, 2, 4, True, False, True, True),
    ("opt", DISK, 2, 1, False, False, True, False),
    ("opt", MIXED, 3, 2, True, True, True, True),
    ("opt", MIXED, 3, 3, False, False, False, True),
    ("opt", MIXED2, 2, 4, True, False, True, False),
    ("opt-post", DISK, 2, 2, True, False, True, True),
    ("opt-post", MIXED, 3, 2, False, True, True, False),
    ("opt-post", HOST, 2, 4, True, False, False, True),
    ("llama-gqa", COMPUTE, 2, 2, True, False, True, False),
    ("llama-gqa", HOST, 2, 1, True, False, True, True),
    ("llama-gqa", HOST, 2, 4, False, True, False, True),
    ("llama-gqa", DISK, 2, 3, True, False, True, True),
    ("llama-gqa", DISK, 2, 2, False, False, True, False),
    ("llama-gqa", MIXED, 3, 2, True, False, True, True),
    ("llama-gqa", MIXED, 3, 3, False, True, True, False),
    ("llama-gqa", MIXED2, 2, 4, True, False, False, True),
]


def _case_id(case) -> str:
    kind, pct, gbs, nb, overlap, ccc, pin, sep = case
    return (f"{kind}-{'_'.join(map(str, pct))}-b{gbs}x{nb}-{'ov' if overlap else 'seq'}"
            f"{'-ccc' if ccc else ''}{'-nopin' if not pin else ''}{'-fused' if not sep else ''}")


@functools.lru_cache(maxsize=None)
def _model(kind):
    return tiny_hf(kind)


@functools.lru_cache(maxsize=None)
def _hf(kind):
    model = _model(kind)
    return hf_greedy(model, PROMPTS, N_NEW, pad_id=model.config.pad_token_id)


def _same_as_hf(kind, tokens, logits, hf_tokens, hf_logits, s):
    """The engine against transformers: other fp32 orders (kernels, GEMMs), so tokens equal but at a near tie
    and logits within tolerances.logit_bound up to there."""
    bound = logit_bound(_model(kind), torch.stack(hf_logits))
    n = greedy_agreement(tokens, hf_tokens, hf_logits, bound, f"sequence {s}")
    assert max_logit_diff(logits[:n], hf_logits[:n]) <= bound, f"sequence {s}"


@functools.lru_cache(maxsize=None)
def _reference(kind, gbs, nb):
    """All-compute, no overlap, same block / batch shapes (padding is per block, so shapes must match)."""
    engine = make_engine(_model(kind), offload=OffloadPolicy.from_percent(
        COMPUTE, gpu_batch_size=gbs, num_gpu_batches=nb, overlap=False, kv_dtype="float32"))
    out = engine.generate(PROMPTS, greedy(N_NEW))
    return out.token_ids, engine.step_logits


def _policy(pct, gbs, nb, overlap, ccc, pin, sep) -> OffloadPolicy:
    return OffloadPolicy.from_percent(pct, gpu_batch_size=gbs, num_gpu_batches=nb, overlap=overlap,
                                      cpu_cache_compute=ccc, pin_weight=pin, sep_layer=sep, kv_dtype="float32")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_placement_gives_identical_greedy_run(case, tmp_path):
    kind, pct, gbs, nb, overlap, ccc, pin, sep = case
    engine = make_engine(_model(kind), offload=_policy(pct, gbs, nb, overlap, ccc, pin, sep), offload_dir=tmp_path)
    try:
        disk_kv_or_act = any(engine.offload.tier_fractions(w)[2] > 0 for w in ("cache", "act"))
        # a run folder exists exactly when KV or activations may land on disk (weights on disk are the store's)
        assert (engine.offload_dir is not None) == disk_kv_or_act
        run_dir = engine.offload_dir.path if disk_kv_or_act else None
        if run_dir is not None:
            assert run_dir.parent == tmp_path and run_dir.is_dir()
        out = engine.generate(PROMPTS, greedy(N_NEW))

        # the placement is real: weights homed (and staged from) the tiers the percents name
        resident = engine.weights.summary()
        if pct == COMPUTE:
            assert resident["host"] == resident["disk"] == 0 and not engine.weights.bytes_read
        elif pct == HOST:
            assert resident["compute"] == resident["disk"] == 0 and engine.weights.bytes_read["host"] > 0
        elif pct == DISK:
            assert resident["compute"] == resident["host"] == 0 and engine.weights.bytes_read["disk"] > 0
            assert os.listdir(run_dir), "KV / activations on disk should have files in the run folder"
        elif pct == MIXED:
            assert all(resident[t] > 0 for t in ("compute", "host", "disk"))
            assert os.listdir(run_dir)

        ref_tokens, ref_logits = _reference(kind, gbs, nb)
        assert out.token_ids == ref_tokens
        for s in range(len(PROMPTS)):
            assert len(engine.step_logits[s]) == N_NEW
            assert max_logit_diff(engine.step_logits[s], ref_logits[s]) <= SAME_RUN_TOL

        for s, (hf_tokens, hf_logits) in enumerate(_hf(kind)):
            _same_as_hf(kind, out.token_ids[s], engine.step_logits[s], hf_tokens, hf_logits, s)
    finally:
        engine.close()
    assert run_dir is None or not run_dir.exists()
    assert os.listdir(tmp_path) == []                      # no leftover files under the offload root


@pytest.mark.parametrize("kind, pct, rows", [("opt", MIXED, 1), ("llama-gqa", MIXED2, 2), ("opt-post", DISK, 3)])
def test_chunked_prefill_gives_transformers_tokens(kind, pct, rows, tmp_path):
    """A 7-sequence GPU batch prefilled `rows` sequences at a time, on mixed and disk placements."""
    offload = OffloadPolicy.from_percent(pct, gpu_batch_size=len(PROMPTS), prefill_batch_size=rows,
                                         kv_dtype="float32")
    engine = make_engine(_model(kind), offload=offload, offload_dir=tmp_path)
    try:
        out = engine.generate(PROMPTS, greedy(N_NEW))
        for s, (hf_tokens, hf_logits) in enumerate(_hf(kind)):
            _same_as_hf(kind, out.token_ids[s], engine.step_logits[s], hf_tokens, hf_logits, s)
    finally:
        engine.close()


def test_prefill_rows_default_and_validation():
    policy = OffloadPolicy(gpu_batch_size=64)
    assert policy.prefill_rows(64, 2048) == 2            # 4096 prompt tokens per forward by default
    assert policy.prefill_rows(64, 100) == 40
    assert policy.prefill_rows(3, 16) == 3               # never more than the batch
    assert policy.prefill_rows(64, 9000) == 1
    assert OffloadPolicy(prefill_batch_size=5).prefill_rows(64, 2048) == 5
    assert policy.prefill_rows(64, 2048, "cuda") == 8           # 16384 on a GPU, where launches cost more
    assert OffloadPolicy(prefill_batch_size=5).prefill_rows(64, 2048, "cuda") == 5
    with pytest.raises(ConfigError, match="prefill-batch-size"):
        OffloadPolicy(prefill_batch_size=0).validate()


def test_engine_reused_then_closed_leaves_nothing(tmp_path):
    kind = "llama-gqa"
    with make_engine(_model(kind), offload=_policy(DISK, 2, 2, True, False, True, True),
                     offload_dir=tmp_path) as engine:
        first = engine.generate(PROMPTS, greedy(N_NEW)).token_ids
        n_files = len(os.listdir(engine.offload_dir.path))
        second = engine.generate(PROMPTS, greedy(N_NEW)).token_ids
        assert first == second == _reference(kind, 2, 2)[0]
        # the second run released the first run's files before allocating its own: no growth
        assert len(os.listdir(engine.offload_dir.path)) == n_files
    assert os.listdir(tmp_path) == []
    engine.close()                                         # idempotent
    assert os.listdir(tmp_path) == []


# --- OffloadPolicy validation ---

@pytest.mark.parametrize("pct, message", [
    ([101, 0, 100, 0, 100, 0], "w_gpu=101 is outside 0..100"),
    ([0, -5, 100, 0, 100, 0], "w_cpu=-5 is outside 0..100"),
    ([100, 0, 100, 0, 100, 150], "act_cpu=150 is outside 0..100"),
    ([60, 50, 100, 0, 100, 0], "weights sums to 110 > 100"),
    ([100, 0, 70, 40, 100, 0], "cache sums to 110 > 100"),
    ([100, 0, 100, 0, 99, 2], "activations sums to 101 > 100"),
])
def test_bad_percents_rejected(pct, message):
    with pytest.raises(ConfigError, match=message):
        OffloadPolicy.from_percent(pct).validate()


@pytest.mark.parametrize("gbs, nb", [(0, 1), (1, 0), (-2, 1)])
def test_bad_batch_sizes_rejected(gbs, nb):
    with pytest.raises(ConfigError, match=r"--gpu-batch-size .* must be >= 1"):
        OffloadPolicy(gpu_batch_size=gbs, num_gpu_batches=nb).validate()


def test_wrong_percent_count_and_kv_dtype_rejected():
    with pytest.raises(ConfigError, match="6 numbers"):
        OffloadPolicy.from_percent([100, 0, 100])
    with pytest.raises(ConfigError, match="kv_dtype"):
        OffloadPolicy(kv_dtype="bfloat16").validate()


def test_engine_validates_its_policy():
    with pytest.raises(ConfigError, match="outside 0..100"):
        make_engine(_model("opt"), offload=OffloadPolicy.from_percent([100, 0, 100, 0, 100, 120]))


@pytest.mark.parametrize("pct", [DISK, [100, 0, 0, 0, 100, 0], [100, 0, 100, 0, 0, 0], MIXED])
def test_disk_placement_without_offload_dir_is_a_config_error(pct):
    with pytest.raises(ConfigError, match="offload.dir"):
        engine = make_engine(_model("opt"), offload=_policy(pct, 3, 1, False, False, True, True))
        engine.generate(PROMPTS[:3], greedy(2))


def test_weights_only_on_disk_need_no_offload_dir():
    # weights homed on disk are the store's own files: no run folder needed when KV and activations stay up
    engine = make_engine(_model("opt"), offload=_policy([0, 0, 100, 0, 100, 0], 2, 2, True, False, True, True))
    assert engine.generate(PROMPTS, greedy(N_NEW)).token_ids == _reference("opt", 2, 2)[0]
    engine.close()


def test_engine_checks_disk_space_for_the_block_before_writing(tmp_path, monkeypatch):
    policy = OffloadPolicy.from_percent([100, 0, 50, 0, 0, 50], gpu_batch_size=2, num_gpu_batches=2,
                                        kv_dtype="float32")
    engine = make_engine(tiny_hf("llama-gqa"), offload=policy, offload_dir=tmp_path, record=False)
    prompts = random_prompts([5, 7, 4, 6])
    engine.generate(prompts, greedy(3))
    needed = engine.last_plan.disk_bytes()
    assert needed > 0 and engine.tiers["disk"].peak_bytes == needed  # the estimate is what the files took
    engine.release()
    real_usage = shutil.disk_usage

    def almost_full(path):
        return real_usage(path)._replace(free=needed - 1)
    monkeypatch.setattr("flexgen_h2o.memory.offload_dir.shutil.disk_usage", almost_full)
    with pytest.raises(DiskSpaceError, match=f"needs {needed} bytes but only {needed - 1} bytes are free"):
        engine.generate(prompts, greedy(3))
    # nothing was written but the run folder's own lock (memory/offload_dir.py: it marks the folder live)
    assert [p.name for p in engine.offload_dir.path.iterdir()] == [".lock"]
    engine.close()
