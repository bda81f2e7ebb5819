"""--compress-weight: the packed matrices (weights/compressed.py) against transformers' own model whose matrices
hold what quantization gives back, on every tier; the compressed store folder; the planner's bytes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flexgen_h2o.config import OffloadPolicy
from flexgen_h2o.engine import Engine
from flexgen_h2o.kv import EvictionConfig
from flexgen_h2o.models import PRESETS, build_layers
from flexgen_h2o.planner import estimate
from flexgen_h2o.quant import PackedMatrix
from flexgen_h2o.weights.placement import model_bytes, packed_names
from flexgen_h2o.weights.store import open_store
from flexgen_h2o.weights.writer import StoreWriter
from tests.helpers import greedy, hf_greedy, make_engine, max_logit_diff, random_prompts, tiny_hf, weight_reader
from tests.reference.fake_quant import fake_quant
from tests.tolerances import assert_within, dot_bound, gamma, greedy_agreement, logit_bound

N_NEW = 8
WEIGHTS_ON = {"compute": dict(weights_gpu_pct=100), "host": dict(weights_gpu_pct=0, weights_cpu_pct=100),
              "disk": dict(weights_gpu_pct=0, weights_cpu_pct=0)}


def quantized_hf(kind: str, bits: int):
    """The tiny model with every multiplied matrix (each nn.Linear not tied to an embedding) replaced by its
    fake-quantized values: groups of 64 along the input dimension."""
    model = tiny_hf(kind)
    tables = {m.weight.data_ptr() for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.weight.data_ptr() not in tables:
                m.weight.copy_(fake_quant(m.weight, bits, 64))
    return model


@pytest.mark.parametrize("kind, bits", [("opt", 4), ("llama-gqa", 4), ("llama-mha", 8)])
def test_packed_weights_match_transformers_with_the_same_quantized_matrices(kind, bits):
    prompts = random_prompts([12, 7])
    engine = make_engine(tiny_hf(kind), offload=OffloadPolicy(weight_bits=bits, gpu_batch_size=2, kv_dtype="float32"),
                         eviction=EvictionConfig(policy="full"))
    try:
        out = engine.generate(prompts, greedy(N_NEW))
        staged = engine.weights.stage(1)
        assert any(isinstance(w, PackedMatrix) for w in staged.values())
    finally:
        engine.close()
    want = hf_greedy(quantized_hf(kind, bits), prompts, N_NEW, pad_id=0)
    plain = hf_greedy(tiny_hf(kind), prompts, N_NEW, pad_id=0)
    for i, (tokens, logits) in enumerate(want):
        # the same quantized matrices (a weight's codes come from the weight alone: no input differs), products
        # in other fp32 orders: tokens equal but at a near tie, logits within the model's fp32 bound
        bound = logit_bound(tiny_hf(kind), torch.stack(logits))
        n = greedy_agreement(out.token_ids[i], tokens, logits, bound, f"sequence {i}")
        assert max_logit_diff(engine.step_logits[i][:n], logits[:n]) <= bound, f"sequence {i}"
        assert max_logit_diff(engine.step_logits[i], plain[i][1]) > 1e-3 > bound  # the rounding is really there


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    model = tiny_hf("llama-gqa")
    cfg, read = weight_reader(model)
    dest = tmp_path_factory.mktemp("store") / "tiny"
    with StoreWriter(dest, cfg) as w:
        for layer in build_layers(cfg):
            for spec in layer.weight_specs():
                if spec.name not in w.tensors:
                    w.write(spec.name, read(spec.name))
        w.commit()
    return model, cfg, dest


@pytest.mark.parametrize("where", list(WEIGHTS_ON))
def test_every_weight_tier_reads_the_compressed_store(store, tmp_path, where):
    model, cfg, dest = store
    leftover = dest / "int4-g64.tmp-999999999-dead"          # a killed conversion's folder
    leftover.mkdir(exist_ok=True)
    reader = open_store(dest)
    prompts = random_prompts([12, 7, 9])
    read_bytes, layer_bytes, outs = {}, {}, {}
    for bits in (4, None):
        offload = OffloadPolicy(weight_bits=bits, gpu_batch_size=3, kv_dtype="float32", **WEIGHTS_ON[where])
        engine = Engine(cfg, reader.read, locate=reader.locate, offload=offload, offload_dir=str(tmp_path))
        try:
            outs[bits] = engine.generate(prompts, greedy(N_NEW))
            read_bytes[bits] = engine.weights.bytes_read.get("disk", 0)
            layer_bytes[bits] = sum(engine.weights.layer_bytes(i) for i in range(len(engine.layers)))
        finally:
            engine.close()
    assert not leftover.exists()
    folder = dest / "int4-g64"
    names = packed_names(build_layers(cfg))
    assert {p.stem for p in folder.glob("*.npy")} == names
    assert all(np.load(folder / f"{n}.npy", mmap_mode="r").dtype == np.uint8 for n in names)
    want = hf_greedy(quantized_hf("llama-gqa", 4), prompts, N_NEW, pad_id=0)
    assert outs[4].token_ids == [t for t, _ in want]
    if where == "disk":    # the disk carried the packed bytes: the same passes read fewer bytes, in proportion
        assert read_bytes[4] > 0
        assert read_bytes[4] / read_bytes[None] == pytest.approx(layer_bytes[4] / layer_bytes[None])
        assert layer_bytes[4] < 0.45 * layer_bytes[None]


def test_the_planner_counts_packed_bytes():
    cfg, ev = PRESETS["opt-1.3b"], EvictionConfig()
    layers = build_layers(cfg)
    plain, int4, int8 = (estimate(cfg, OffloadPolicy(gpu_batch_size=4, weight_bits=b, weights_gpu_pct=0,
                                                     weights_cpu_pct=0), ev, prompt_len=32, gen_len=8)
                         for b in (None, 4, 8))
    assert plain.model_bytes == model_bytes(layers) == 2 * cfg.n_params()
    # every multiplied matrix at 36 / 128 of its fp16 bytes (4-bit) or 68 / 128 (8-bit); the tied embedding stays
    table = 2 * cfg.vocab_size * cfg.hidden_size + 2 * cfg.max_seq_len * cfg.hidden_size
    assert int4.model_bytes < table + 0.3 * (plain.model_bytes - table)
    assert int8.model_bytes < table + 0.55 * (plain.model_bytes - table)
    assert int4.store_bytes == int4.model_bytes < 0.45 * plain.store_bytes      # every weight homed on disk
    # a dummy store about to be written: its fp16 files and, compressed, the packed copy converted beside them
    kw = dict(prompt_len=32, gen_len=8, dummy_store_bytes=plain.model_bytes)
    off = OffloadPolicy(gpu_batch_size=4, weights_gpu_pct=0, weights_cpu_pct=0)
    disk_plain, disk_int4 = (estimate(cfg, off.replace(weight_bits=b), ev, **kw).bytes["disk"]["weights"]
                             for b in (None, 4))
    assert disk_int4 - disk_plain == int4.model_bytes


@pytest.mark.parametrize("invariant", ["0", "1"])
def test_linear_sends_few_rows_to_the_kernel_and_many_to_the_gemm(monkeypatch, invariant):
    """A decode step's rows go to csrc/quant_linear.cpp; a prompt's (more than QUANT_LINEAR_MAX_ROWS) to the
    dequantized blocks and the GEMM, which is faster there, unless batch invariance sends every row count to the
    kernel; both give the product of the dequantized weight."""
    from flexgen_h2o.kernels import dispatch, resolve
    from flexgen_h2o.quant import GroupQuant
    monkeypatch.setenv(dispatch.INVARIANT_SWITCH, invariant)
    kernels = resolve()
    if kernels.ext is None or not hasattr(kernels.ext, "quant_linear"):
        pytest.skip("no compiled kernels")
    calls = []
    real = kernels.ext.quant_linear
    monkeypatch.setattr(kernels.ext, "quant_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    gen = torch.Generator().manual_seed(3)
    quant = GroupQuant(4, 64)
    w = PackedMatrix(quant.pack_rows(torch.randn(48, 96, generator=gen) * 0.1), 96, quant)
    bias = torch.randn(48, generator=gen)
    for rows in (1, dispatch.QUANT_LINEAR_MAX_ROWS, dispatch.QUANT_LINEAR_MAX_ROWS + 1):
        x = torch.randn(rows, 96, generator=gen)
        want = x.double() @ w.values(torch.float64).T + bias.double()
        # against the exact product: k terms, each weight dequantized with up to 2 roundings, and the bias
        # added (one more term): gamma(k + 3) (sum |x w| + |bias|), dot_bound's two orders being 2x that
        bound = dot_bound(x, w.values(torch.float32), extra=3) + 2 * gamma(96 + 3) * bias.double().abs()
        assert_within(kernels.linear(x, w, bias), want, bound, f"{rows} rows")
    sizes = [1, dispatch.QUANT_LINEAR_MAX_ROWS, dispatch.QUANT_LINEAR_MAX_ROWS + 1]
    assert calls == (sizes if invariant == "1" else sizes[:2])


def test_weights_without_a_store_are_packed_as_placed_and_not_kept_twice():
    """Dummy weights have no store to convert: each matrix is packed when the placement reads it, and only the
    placement holds it (numpy's peak while placing stays at one matrix's scratch). Keeping every packed matrix in
    a cache as well (as before) doubled the RAM: OPT-1.3B int8 from dummy weights peaked at 3.57 GiB against 2.17
    predicted."""
    import tracemalloc

    from flexgen_h2o.weights import DummyStore
    from flexgen_h2o.models import all_specs
    cfg = PRESETS["smollm2-135m"].replace(n_layers=8, hidden_size=256, ffn_size=512, vocab_size=512)
    specs = all_specs(build_layers(cfg))
    packed = sum(s.numel for s in specs if s.name in packed_names(build_layers(cfg)))
    DummyStore(specs).read(specs[1].name)      # the dummy generator's pool, held for good, made before tracing
    tracemalloc.start()                         # numpy's arrays are traced, torch's tensors are not
    try:
        engine = Engine(cfg, DummyStore(specs).read, offload=OffloadPolicy(weight_bits=8, gpu_batch_size=1))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    try:
        assert engine.weights.resident_bytes["compute"] > 0.5 * packed           # the placement holds them
        # one matrix's packing scratch at a time, not every packed matrix at once
        assert peak < 0.3 * packed, f"numpy arrays peaked at {peak} bytes while packing {packed} int8 values"
    finally:
        engine.close()
