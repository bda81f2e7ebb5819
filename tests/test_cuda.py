"""The fp16 CUDA path (what a GPU user runs) against the fp32 CPU engine, and the CLI on a GPU with weights, KV
and activations offloaded. Marked gpu: skipped where torch sees no CUDA device (CI). On a GPU:
`pytest -m gpu tests`; the rest of the suite runs there too, in fp32, with FLEXGEN_H2O_TEST_DEVICE=cuda."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flexgen_h2o.config import OffloadPolicy
from flexgen_h2o.engine import Engine
from flexgen_h2o.kv import EvictionConfig
from tests.helpers import engine_kept, greedy, make_engine, random_prompts, tiny_hf

pytestmark = pytest.mark.gpu

PROMPTS = random_prompts([9, 14, 5, 12, 11], seed=5)
N_NEW = 8
PLACEMENTS = {"compute": [100, 0, 100, 0, 100, 0], "host": [0, 100, 0, 100, 0, 100],
              "mixed": [30, 40, 20, 30, 34, 33], "disk": [0, 0, 0, 0, 0, 0]}
H2O = EvictionConfig(policy="h2o", hh_size=3, recent_size=3)
# fp16 compute against fp32: the logits of tiny random models agree to ~1e-3 of their range; 2 % leaves room
# for accumulation order and still catches a wrong scale, mask or position (those move logits by their range)
REL_TOL = 0.02


def run_engine(kind: str, device: str, dtype: torch.dtype, placement: str, ev: EvictionConfig | None,
               offload_dir: Path | None = None, **policy) -> tuple[list[list[int]], dict, Engine]:
    pol = OffloadPolicy.from_percent(PLACEMENTS[placement], gpu_batch_size=2, num_gpu_batches=3,
                                     kv_dtype="float16", **policy)
    engine = make_engine(tiny_hf(kind), offload=pol, eviction=ev, offload_dir=offload_dir, device=device,
                         compute_dtype=dtype)
    with engine:
        out = engine.generate(PROMPTS, greedy(N_NEW))
    return out.token_ids, engine.step_logits, engine


@functools.lru_cache(maxsize=None)
def cpu_reference(kind: str, h2o: bool) -> tuple:
    """The fp32 CPU run, everything on the compute tier (no offload folder needed), once per (kind, policy)."""
    return run_engine(kind, "cpu", torch.float32, "compute", H2O if h2o else None)


def assert_close_run(got: tuple, want: tuple) -> None:
    tokens, logits, _ = got
    ref_tokens, ref_logits, _ = want
    assert tokens == ref_tokens
    assert {s: len(x) for s, x in logits.items()} == {s: len(x) for s, x in ref_logits.items()}
    for s, ref in ref_logits.items():
        for step, (a, b) in enumerate(zip(logits[s], ref)):
            scale = float(b.abs().max())
            err = float((a - b).abs().max())
            assert err <= REL_TOL * scale, f"sequence {s} step {step}: |fp16 - fp32| {err:.4f} vs range {scale:.2f}"


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("kind", ["opt", "llama-gqa"])
def test_fp16_cuda_matches_fp32_cpu(kind, placement, tmp_path):
    ref = cpu_reference(kind, False)
    got = run_engine(kind, "cuda", torch.float16, placement, None, tmp_path)
    assert_close_run(got, ref)
    assert got[2].backend.device_memory()["peak_bytes"] > 0


@pytest.mark.parametrize("placement", ["compute", "mixed"])
@pytest.mark.parametrize("kind", ["opt", "llama-gqa"])
def test_h2o_on_cuda_keeps_what_the_cpu_keeps(kind, placement, tmp_path):
    """Scores accumulate in fp32 on both sides, so the same tokens are kept; the cache stays at its budget."""
    ref = cpu_reference(kind, True)
    got = run_engine(kind, "cuda", torch.float16, placement, H2O, tmp_path)
    assert_close_run(got, ref)
    kept = engine_kept(got[2])
    assert kept == engine_kept(ref[2])
    assert max(len(heads) for layer in kept for seq in layer for heads in seq) == H2O.hh_size + H2O.recent_size


@pytest.mark.parametrize("placement", ["compute", "mixed"])
def test_compressed_weights_and_kv_on_cuda(placement, tmp_path):
    """--compress-weight --compress-cache on a GPU (packed bytes cross, dequantized there) against the fp32 CPU
    engine with the same formats (the CPU's compiled kernels read them in place)."""
    formats = dict(kv_bits=4, weight_bits=4)
    ref = run_engine("llama-gqa", "cpu", torch.float32, "compute", H2O, **formats)
    got = run_engine("llama-gqa", "cuda", torch.float16, placement, H2O, tmp_path, **formats)
    assert_close_run(got, ref)
    assert engine_kept(got[2]) == engine_kept(ref[2])


def test_chunked_prefill_on_cuda(tmp_path):
    """One sequence per prefill chunk, every tier in use: the case that aborted a test worker on an H200 in fp32
    (2026-11-26, tests/test_equivalence.py::test_chunked_prefill_gives_transformers_tokens[opt-pct0-1])."""
    ref = cpu_reference("opt", False)
    got = run_engine("opt", "cuda", torch.float16, "mixed", None, tmp_path,
                     prefill_batch_size=1)
    assert_close_run(got, ref)


def test_a_staged_tensor_is_read_after_its_copy_lands():
    """The lane -> compute ordering, made deterministic: the lane's stream sleeps before its copy, so a reader
    that only waited for the job's future (done once the copy is enqueued) would sum memory the copy has not
    written yet. Under 8 xdist workers that race read out-of-range slot indices (H100, 2026-11-26)."""
    from flexgen_h2o.backend import get_backend
    from flexgen_h2o.memory import Transfer
    transfer = Transfer(get_backend("cuda"))
    src = torch.arange(1 << 20, dtype=torch.float32).pin_memory()

    def stage():
        torch.cuda._sleep(200_000_000)          # ~0.1 s of GPU clock cycles on the lane's stream
        dst = torch.empty(src.shape, device="cuda")
        dst.copy_(src, non_blocking=True)
        return dst
    try:
        staged = transfer.collect(transfer.submit("kv", stage))
        assert staged.sum().item() == src.sum().item()
    finally:
        transfer.close()


def test_cpu_cache_compute_on_cuda(tmp_path):
    """Decode attention where the KV lives (host), FlexGen's cpu_cache_compute, on a GPU run."""
    ref = cpu_reference("opt", False)
    got = run_engine("opt", "cuda", torch.float16, "host", None, tmp_path,
                     cpu_cache_compute=True)
    assert_close_run(got, ref)


@pytest.mark.parametrize("eviction", [["--full-cache"], ["--hh-ratio", "0.1"]])
def test_cli_on_cuda_with_everything_offloaded(eviction, tmp_path):
    """The CLI on a GPU, weights half on the host, KV half on disk: the measured device peak stays within the
    engine's own compute-tier accounting (plus CUDA's allocator slack), and no offload file outlives the run."""
    metrics, offload = tmp_path / "m.json", tmp_path / "offload"
    cmd = [sys.executable, "-m", "flexgen_h2o.run", "--model", "opt-125m", "--dummy-weights", "--device", "cuda",
           "--prompt-len", "64", "--gen-len", "16", "--gpu-batch-size", "4", "--num-gpu-batches", "2",
           "--percent", "50", "50", "50", "0", "100", "0", "--offload-dir", str(offload),
           "--metrics-json", str(metrics), "--no-progress", *eviction]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(metrics.read_text())
    assert m["generated_tokens"] == 8 * 16 and m["decode_tok_s"] > 0
    assert 0 < m["device_peak_bytes"] <= 1.5 * m["peak_compute_bytes"] + (64 << 20), m
    assert not offload.exists() or not any(offload.iterdir())


@pytest.mark.parametrize("placement", ["compute", "mixed"])
def test_refill_on_cuda_matches_each_prompt_alone(placement, tmp_path):
    """Continuous refill on a GPU (rows reset in place in device memory, join passes, per-row positions): each
    prompt's tokens are what it gets alone on the same device, up to an fp16 near-tie (top-2 within 1e-2)."""
    max_new = [2, 8, 3, 1, 6]
    alone = []
    for i, p in enumerate(PROMPTS):
        engine = make_engine(tiny_hf("llama-gqa"), offload=OffloadPolicy(gpu_batch_size=1, kv_dtype="float16"),
                             eviction=H2O, device="cuda", compute_dtype=torch.float16)
        with engine:
            alone.append((engine.generate([p], greedy(max_new[i])).token_ids[0], engine.step_logits[0]))
    pol = OffloadPolicy.from_percent(PLACEMENTS[placement], gpu_batch_size=2, num_gpu_batches=1, kv_dtype="float16")
    engine = make_engine(tiny_hf("llama-gqa"), offload=pol, eviction=H2O, offload_dir=tmp_path, device="cuda",
                         compute_dtype=torch.float16)
    with engine:
        got = {f.index: f.token_ids for done in engine.generate_refill(PROMPTS, greedy(8), max_new_tokens=max_new)
               for f in done}
        assert engine.last_refill_metrics["joins"] >= 3
    for i, (tokens, logits) in enumerate(alone):
        if got[i] != tokens:
            t = next(n for n, (a, b) in enumerate(zip(tokens, got[i])) if a != b)
            top = logits[t].float().topk(2).values
            assert float(top[0] - top[1]) < 1e-2, f"prompt {i} differs at step {t} without a near-tie"
