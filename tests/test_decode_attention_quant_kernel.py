"""The compiled decode attention over a group-wise quantized cache (csrc/decode_attention.cpp's
decode_attention_quant) against the torch-op path on the dequantized window: quant.py's row form read in place,
its masked slots never read, the new token used unrounded. The package's own build, the one the engine runs."""
from __future__ import annotations

import pytest
import torch

from flexgen_h2o.models import ops
from flexgen_h2o.quant import GroupQuant
from tests.tolerances import assert_within, decode_attention_bounds


@pytest.fixture
def ext(kernel):
    """The package's build of the kernels (tests/conftest.py), which binds decode_attention_quant."""
    return kernel.ext


def _step(b, g, r, s, d, capacity, bits, group_size, free=0.3, seed=0, q_scale=1.0):
    """One decode step over quantized windows that are the first s of `capacity` slots of a packed cache."""
    gen = torch.Generator().manual_seed(seed)
    quant = GroupQuant(bits, group_size)
    k = quant.pack_rows(torch.randn(b, g, capacity, d, generator=gen))[:, :, :s]
    v = quant.pack_rows(torch.randn(b, g, capacity, d, generator=gen) * 2 + 0.5)[:, :, :s]
    q = torch.randn(b, g * r, 1, d, generator=gen) * q_scale
    slot = torch.randint(0, s, (b, g), generator=gen)
    valid = torch.rand(b, g, s, generator=gen) > free
    valid.scatter_(2, slot.unsqueeze(-1), True)
    k_new, v_new = torch.randn(b, g, 1, d, generator=gen), torch.randn(b, g, 1, d, generator=gen)
    return q, k, v, valid, slot, k_new, v_new


def _reference(quant, q, k, v, valid, slot, k_new, v_new, scale, reduce):
    d = q.shape[-1]
    return ops.narrow_decode_attention(q, quant.unpack_rows(k, d), quant.unpack_rows(v, d), valid, slot, k_new,
                                       v_new, scale, want_scores=True, score_reduce=reduce)


def _within_bounds(got, want, quant, args, scale, reduce="sum"):
    """Kernel against the torch path on the dequantized window: two fp32 orders, and each value dequantized by
    each path with up to 2 roundings (q * step + min, or one FMA) relative to |q step| + |min|:
    tolerances.decode_attention_bounds with extra=2 on the group's magnitude."""
    q, k, v, valid, slot, k_new, v_new = args
    d = q.shape[-1]
    values = (quant.unpack_rows(k, d), quant.unpack_rows(v, d))
    out_bound, mass_bound = decode_attention_bounds(q, *values, valid, slot, k_new, v_new, scale, reduce, extra=2,
                                                    group=quant.group_size)
    assert_within(got[0], want[0], out_bound, "output")
    assert_within(got[1], want[1], mass_bound, "key mass")


CASES = [   # b, g, r, s, d, capacity, group_size
    (2, 3, 3, 409, 64, 420, 64),     # SmolLM2's GQA: 102 blocks of 4 keys and a tail of 1, a narrow view
    (2, 2, 1, 300, 128, 300, 64),    # one head per group: blocks of 8 keys and a tail of 4; two groups a row
    (2, 2, 5, 37, 128, 40, 64),      # 5 heads per group: a pass of 3 then 2
    (3, 1, 3, 1, 64, 1, 64),         # the new token alone
    (2, 2, 2, 19, 32, 24, 32),       # 32 dims in one group
    (2, 1, 3, 23, 48, 30, 64),       # a padded last group (48 of 64) on the 8-wide loops
    (2, 2, 3, 21, 64, 21, 16),       # groups of 16: four a row
    (1, 2, 3, 17, 24, 20, 6),        # groups of 6 (not a multiple of 8): the plain loops
    (1, 2, 5, 11, 12, 11, 8),        # 12 dims (not a multiple of 8), a padded group: the plain loops
]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("b, g, r, s, d, capacity, group_size", CASES)
@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_matches_the_torch_path_on_the_dequantized_window(ext, bits, b, g, r, s, d, capacity, group_size, reduce):
    quant = GroupQuant(bits, group_size)
    args = _step(b, g, r, s, d, capacity, bits, group_size)
    q, k, v, valid = args[:4]
    before = k.clone(), v.clone()
    out, mass = ext.decode_attention_quant(*args, 0.3, True, reduce == "mean", bits, group_size)
    ref_out, ref_mass = _reference(quant, *args, 0.3, reduce)
    _within_bounds((out, mass), (ref_out, ref_mass), quant, args, 0.3, reduce)
    assert torch.all(mass[~valid] == 0)
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])       # read only
    out_only, empty = ext.decode_attention_quant(*args, 0.3, False, False, bits, group_size)
    assert empty.numel() == 0 and torch.equal(out_only, out)


@pytest.mark.parametrize("bits", [4, 8])
def test_peaked_attention_and_the_unrounded_new_token(ext, bits):
    quant = GroupQuant(bits, 64)
    args = _step(2, 3, 3, 50, 64, 64, bits, 64, q_scale=12.0)
    got = ext.decode_attention_quant(*args, 0.125, True, False, bits, 64)
    _within_bounds(got, _reference(quant, *args, 0.125, "sum"), quant, args, 0.125)
    q, k, v, valid, slot, k_new, v_new = args
    rounded = ext.decode_attention_quant(q, k, v, valid, slot, k_new.half().float(), v_new.half().float(), 0.125,
                                         True, False, bits, 64)
    assert not torch.equal(rounded[0], got[0])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("d, group_size", [(64, 64), (128, 64), (12, 8)])
def test_masked_slots_and_the_new_tokens_row_are_never_read(ext, bits, d, group_size):
    """Random bytes in every masked slot and in the new token's own slot, steps and minima NaN and inf among
    them: the output and the mass are the clean window's, bit for bit."""
    q, k, v, valid, slot, k_new, v_new = _step(3, 2, 3, 45, d, 50, bits, group_size, free=0.4)
    clean = ext.decode_attention_quant(q, k, v, valid, slot, k_new, v_new, 0.3, True, False, bits, group_size)
    unread = ~valid
    unread.scatter_(2, slot.unsqueeze(-1), True)
    gen = torch.Generator().manual_seed(1)
    dirty_k, dirty_v = k.clone(), v.clone()
    width = GroupQuant(bits, group_size).row_bytes(d)
    for dirty in (dirty_k, dirty_v):
        dirty[unread] = torch.randint(0, 256, (int(unread.sum()), width), generator=gen, dtype=torch.uint8)
        params = dirty[..., width - 4 * GroupQuant(bits, group_size).groups(d):].view(torch.float16)
        params[..., 0::3][unread] = float("nan")
        params[..., 1::3][unread] = float("inf")
    got = ext.decode_attention_quant(q, dirty_k, dirty_v, valid, slot, k_new, v_new, 0.3, True, False, bits,
                                     group_size)
    assert torch.equal(got[0], clean[0]) and torch.equal(got[1], clean[1])


def test_the_same_on_one_thread_and_two(ext):
    args = _step(5, 3, 3, 100, 64, 128, 4, 64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ext.decode_attention_quant(*args, 0.3, True, False, 4, 64)
        torch.set_num_threads(2)
        two = ext.decode_attention_quant(*args, 0.3, True, False, 4, 64)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_the_fp16_entry_point_still_gives_the_torch_paths_values(ext):
    """decode_attention shares the loops (their fp16 reader): the same contract as before."""
    gen = torch.Generator().manual_seed(2)
    b, g, r, s, d = 2, 3, 3, 67, 64
    k = torch.randn(b, g, 80, d, generator=gen).half()[:, :, :s]
    v = torch.randn(b, g, 80, d, generator=gen).half()[:, :, :s]
    _, _, _, valid, slot, k_new, v_new = _step(b, g, r, s, d, s, 8, 64)
    q = torch.randn(b, g * r, 1, d, generator=gen)
    got = ext.decode_attention(q, k, v, valid, slot, k_new, v_new, 0.3, True, True)
    ref = ops.narrow_decode_attention(q, k, v, valid, slot, k_new, v_new, 0.3, want_scores=True, score_reduce="mean")
    # fp16 rows upcast exactly: two fp32 orders of the same values
    out_bound, mass_bound = decode_attention_bounds(q, k, v, valid, slot, k_new, v_new, 0.3, "mean")
    assert_within(got[0], ref[0], out_bound, "output")
    assert_within(got[1], ref[1], mass_bound, "key mass")


def test_bad_inputs_are_refused_by_name(ext):
    q, k, v, valid, slot, k_new, v_new = _step(2, 2, 2, 10, 64, 10, 8, 64)
    with pytest.raises(RuntimeError, match="uint8"):
        ext.decode_attention_quant(q, k.half(), v, valid, slot, k_new, v_new, 0.3, True, False, 8, 64)
    with pytest.raises(RuntimeError, match="row form"):
        ext.decode_attention_quant(q, k, v, valid, slot, k_new, v_new, 0.3, True, False, 4, 64)
    with pytest.raises(RuntimeError, match="bits"):
        ext.decode_attention_quant(q, k, v, valid, slot, k_new, v_new, 0.3, True, False, 3, 64)
    with pytest.raises(RuntimeError, match="group_size"):
        ext.decode_attention_quant(q, k, v, valid, slot, k_new, v_new, 0.3, True, False, 8, 7)
    with pytest.raises(RuntimeError, match="write slot"):
        ext.decode_attention_quant(q, k, v, valid, slot + 10, k_new, v_new, 0.3, True, False, 8, 64)
