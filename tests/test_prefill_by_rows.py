"""Prefill by rows (OffloadPolicy.prefill_by_rows): on a CPU with no disk-homed weight, each prefill chunk goes
through every layer before the next chunk starts. It must give the layer-major prompt pass's results bit for bit,
and no GPU batch's prompt hidden state may rest between layers (the planner's estimate says the same)."""
from __future__ import annotations

import pytest
import torch

from flexgen_h2o.config import OffloadPolicy
from flexgen_h2o.kv import EvictionConfig
from flexgen_h2o.models import from_hf_config
from flexgen_h2o.planner import estimate
from tests.helpers import engine_kept, greedy, make_engine, random_prompts, tiny_hf

LENGTHS = [19, 11, 16, 7, 19, 14, 3]      # padded prompts, two GPU batches of 4 and 3, prefilled 2 rows at a time
N_NEW = 5
HOST_ACTIVATIONS = (100, 0, 100, 0, 0, 100)   # activations rest on the host tier, whose allocations are counted


def test_only_a_cpu_without_disk_weights_prefills_by_rows():
    assert OffloadPolicy.from_percent((100, 0, 100, 0, 100, 0)).prefill_by_rows("cpu")
    assert OffloadPolicy.from_percent((0, 100, 0, 0, 0, 0)).prefill_by_rows("cpu")
    assert not OffloadPolicy.from_percent((50, 30, 100, 0, 100, 0)).prefill_by_rows("cpu")   # 20 % on disk
    assert not OffloadPolicy.from_percent((100, 0, 100, 0, 100, 0)).prefill_by_rows("cuda")


def test_estimate_follows_the_device_not_the_dtype():
    """An fp32 engine on CUDA (the GPU tests' mode) prefills layer-major; inferring the device from 4-byte compute
    priced it as a CPU run (one row per sequence) and under-counted its offload files on a 2026-11-26 H100."""
    model = from_hf_config(tiny_hf("llama").config.to_dict())
    offload = OffloadPolicy.from_percent(HOST_ACTIVATIONS, gpu_batch_size=4, num_gpu_batches=2, kv_dtype="float32")

    def host_activations(**kw) -> int:
        return estimate(model, offload, EvictionConfig(), prompt_len=19, gen_len=N_NEW, n_seqs=7,
                        compute_dtype_bytes=4, **kw).bytes["host"]["activations"]
    assert host_activations(device_type="cuda") == (19 + 1) * 7 * 64 * 4
    assert host_activations(device_type="cpu") == host_activations() == 7 * 64 * 4


def _run(kind: str, eviction: EvictionConfig, by_rows: bool, monkeypatch) -> dict:
    monkeypatch.setattr(OffloadPolicy, "prefill_by_rows", lambda self, device_type: by_rows)
    offload = OffloadPolicy.from_percent(HOST_ACTIVATIONS, gpu_batch_size=4, num_gpu_batches=2,
                                         prefill_batch_size=2, kv_dtype="float32")
    model = tiny_hf(kind)
    engine = make_engine(model, offload=offload, eviction=eviction, device="cpu")
    try:
        out = engine.generate(random_prompts(LENGTHS), greedy(N_NEW))
        est = estimate(from_hf_config(model.config.to_dict()), offload, eviction, prompt_len=max(LENGTHS),
                       gen_len=N_NEW, n_seqs=len(LENGTHS), compute_dtype_bytes=4)
        return {"tokens": out.token_ids, "logits": engine.step_logits, "kept": engine_kept(engine),
                "host_peak": engine.tiers["host"].peak_bytes, "host_estimate": est.bytes["host"]["activations"]}
    finally:
        engine.close()


@pytest.mark.parametrize("kind", ["opt", "llama"])
@pytest.mark.parametrize("eviction", [EvictionConfig(policy="h2o", hh_size=3, recent_size=3),
                                      EvictionConfig(policy="full")], ids=["h2o", "full"])
def test_by_rows_equals_layer_major(kind, eviction, monkeypatch):
    rows = _run(kind, eviction, True, monkeypatch)
    layers = _run(kind, eviction, False, monkeypatch)
    assert rows["tokens"] == layers["tokens"]
    assert rows["kept"] == layers["kept"]
    for s in range(len(LENGTHS)):
        assert len(rows["logits"][s]) == N_NEW
        assert all(torch.equal(a, b) for a, b in zip(rows["logits"][s], layers["logits"][s]))
    # layer-major keeps a prompt-sized and a decode-sized buffer per GPU batch; by rows only the latter
    width = 64 * 4
    assert layers["host_peak"] == (max(LENGTHS) + 1) * len(LENGTHS) * width
    assert rows["host_peak"] == len(LENGTHS) * width
    assert (rows["host_estimate"], layers["host_estimate"]) == (rows["host_peak"], layers["host_peak"])


def test_resident_matrices_stay_fp16_on_a_cpu():
    """Compute-homed matrices keep the store's fp16 on a CPU (ops.linear upcasts them by blocks of rows), vectors
    take the compute dtype, and the planner charges exactly those bytes."""
    model = tiny_hf("opt")
    offload = OffloadPolicy.from_percent((100, 0, 100, 0, 100, 0), gpu_batch_size=2)
    engine = make_engine(model, offload=offload, device="cpu")
    try:
        staged = [engine.weights.stage(i) for i in range(len(engine.layers))]
        tensors = [t for layer in staged for t in layer.values() if isinstance(t, torch.Tensor)]
        assert {t.dtype for t in tensors if t.dim() > 1} == {torch.float16}
        assert {t.dtype for t in tensors if t.dim() == 1} == {torch.float32}
        resident = engine.weights.summary()["compute"]
    finally:
        engine.close()
    est = estimate(from_hf_config(model.config.to_dict()), offload, EvictionConfig(), prompt_len=8, gen_len=2)
    n_matrix = sum(p.numel() for p in model.parameters() if p.dim() > 1)      # the tied head counts once
    n_vector = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    assert est.bytes["compute"]["weights"] == resident == 2 * n_matrix + 4 * n_vector


def test_resident_layers_are_staged_once_and_streamed_ones_each_time():
    """A layer whose weights are all resident is staged once (the same tensors every step: part of a schedule
    layer's fixed cost) and never handed to the pool; a host-homed layer's dict is built afresh each time."""
    model = tiny_hf("opt")
    for percent, cached in (((100, 0, 100, 0, 100, 0), True), ((0, 100, 100, 0, 100, 0), False)):
        engine = make_engine(model, offload=OffloadPolicy.from_percent(percent, gpu_batch_size=2), device="cpu")
        try:
            first = engine.weights.stage(1)
            engine.weights.release(first)
            again = engine.weights.stage(1)
            assert (again is first) == cached
        finally:
            engine.close()
