"""Storage formats (flexgen_h2o.formats): the bytes every tier, link and plan charges come from one place."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flexgen_h2o.config import OffloadPolicy
from flexgen_h2o.formats import FP16, FP32, WEIGHT_FORMAT, quant_format, storage_format
from flexgen_h2o.quant import GroupQuant
from flexgen_h2o.kv import EvictionConfig
from flexgen_h2o.models import PRESETS, KVSpec
from flexgen_h2o.planner import estimate
from flexgen_h2o.weights.store import DTYPE


def test_plain_formats_know_their_bytes_and_round_trip():
    assert (FP16.nbytes(10), FP32.nbytes(10), FP16.bits, FP32.itemsize) == (20, 40, 16, 4)
    x = torch.tensor([1.0, -2.5, 1e-3, 65504.0])
    assert FP16.pack(x).dtype == torch.float16 and FP16.pack(x).element_size() == FP16.itemsize
    assert torch.equal(FP16.unpack(FP16.pack(x), 4, torch.float32), x.half().float())
    assert torch.equal(FP32.unpack(FP32.pack(x), 4, torch.float32), x)
    assert storage_format("float16") is FP16 and storage_format("fp32") is FP32
    with pytest.raises(ValueError, match="unknown storage format 'int3'"):
        storage_format("int3")


def test_the_store_the_policy_and_the_cache_rows_use_the_format():
    assert DTYPE == np.dtype("<f2") == WEIGHT_FORMAT.numpy_dtype
    assert OffloadPolicy(kv_dtype="float32").kv_format is FP32 and OffloadPolicy().kv_format is FP16
    spec = KVSpec(3, 64)
    assert spec.row_bytes(FP16) == 3 * (2 * 64 * 2 + 8) and spec.row_bytes(FP32) == 3 * (2 * 64 * 4 + 8)


def test_the_plan_charges_kv_by_the_format():
    cfg, ev = PRESETS["opt-125m"], EvictionConfig()
    est = {f: estimate(cfg, OffloadPolicy(gpu_batch_size=4, kv_dtype=f), ev, prompt_len=32, gen_len=8)
           for f in ("float16", "float32")}
    slots = cfg.n_layers * 4 * 40 * cfg.n_kv_heads
    assert est["float16"].kv_bytes == slots * (2 * cfg.head_dim * 2 + 8)
    assert est["float32"].kv_bytes == slots * (2 * cfg.head_dim * 4 + 8)
    assert est["float16"].model_bytes == cfg.n_params() * 2


def test_quantized_formats_store_rows_of_bytes_and_count_them():
    int4, int8 = storage_format("int4-g64"), storage_format("int8-g64")
    assert int4 == quant_format(4) and (int4.bits, int8.bits, int4.dtype) == (4, 8, torch.uint8)
    # a 64-wide head: 32 bytes of nibbles + fp16 minimum and step; 8-bit: 64 + 4
    assert (int4.row_width(64), int8.row_width(64), int4.nbytes(3 * 64, 64), int8.nbytes(128, 128)) == \
        (36, 68, 108, 136)
    assert int4.row_width(32) == 20                                     # a row shorter than a group: one group
    x = torch.randn(2, 3, 5, 64, generator=torch.Generator().manual_seed(0))
    stored = int4.pack(x)
    assert stored.shape == (2, 3, 5, 36) and stored.dtype == torch.uint8
    want = GroupQuant(4, 64).unpack(GroupQuant(4, 64).pack(x))
    assert torch.equal(int4.unpack(stored, 64, torch.float32), want)
    staged = int4.stage(stored, torch.device("cpu"), torch.float32, into=torch.empty(2, 3, 5, 64))
    assert torch.equal(staged, want) and torch.equal(int4.stage(stored, torch.device("cpu"), torch.float32, n=64), want)
    with pytest.raises(ValueError, match="pass n or into"):
        int4.stage(stored, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        storage_format("int3-g64")


def test_the_policy_and_the_plan_charge_compressed_kv():
    assert OffloadPolicy(kv_bits=4).kv_format == quant_format(4) and OffloadPolicy(kv_bits=8, group_size=32)\
        .kv_format == quant_format(8, 32)
    assert KVSpec(3, 64).row_bytes(quant_format(4)) == 3 * (2 * 36 + 8)
    cfg, ev = PRESETS["opt-125m"], EvictionConfig()
    est = {bits: estimate(cfg, OffloadPolicy(gpu_batch_size=4, kv_bits=bits), ev, prompt_len=32, gen_len=8)
           for bits in (None, 4, 8)}
    slots = cfg.n_layers * 4 * 40 * cfg.n_kv_heads
    assert est[4].kv_bytes == slots * (2 * (cfg.head_dim // 2 + 4) + 8)
    assert est[8].kv_bytes == slots * (2 * (cfg.head_dim + 4) + 8)
    assert est[4].kv_bytes / est[None].kv_bytes < 0.35
