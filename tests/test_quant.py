"""Group-wise min-max quantization (flexgen_h2o.quant) against a plain reference written here, one group at a time."""
from __future__ import annotations

import pytest
import torch

from flexgen_h2o.quant import PARAM_DTYPE, GroupQuant


def reference(x: torch.Tensor, bits: int, group: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize then dequantize, group by group, as the format's docstring says; also each value's half step."""
    levels = 2 ** bits - 1
    rows = x.float().movedim(dim, -1).reshape(-1, x.shape[dim])
    out, half = torch.empty_like(rows), torch.empty_like(rows)
    for r in range(rows.shape[0]):
        for lo in range(0, rows.shape[1], group):
            values = rows[r, lo:lo + group].tolist()
            values += [values[-1]] * (group - len(values))            # the last group padded by repetition
            low = torch.tensor(min(values)).to(PARAM_DTYPE).float()
            step = torch.tensor((max(values) - min(values)) / levels).to(PARAM_DTYPE).float()
            for i in range(lo, min(lo + group, rows.shape[1])):
                q = 0 if step == 0 else min(max(round(float((rows[r, i] - low) / step)), 0), levels)
                out[r, i] = q * step + low
                half[r, i] = step / 2
    shape = [*x.movedim(dim, -1).shape]
    return out.reshape(shape).movedim(-1, dim), half.reshape(shape).movedim(-1, dim)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape,dim,group", [((3, 64), -1, 64), ((2, 70), -1, 64), ((5, 3, 10), 1, 4),
                                             ((7, 2), 0, 4), ((1, 9), -1, 2)])
def test_round_trip_matches_the_reference_within_half_a_step(bits, shape, dim, group):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(bits + len(shape))) * 3
    fmt = GroupQuant(bits, group, dim)
    stored = fmt.pack(x)
    got = fmt.unpack(stored)
    want, half = reference(x, bits, group, dim % x.dim())
    assert got.shape == x.shape and got.dtype == torch.float32
    # the same elementwise IEEE operations in the same order on both sides (subtract, divide, round, multiply,
    # add: each correctly rounded on every ISA, no sum an ISA may reorder), so equal on every CPU once the fp16
    # step agrees (double here, fp32 there, then fp16: the same value for these inputs, and IEEE-exact too)
    assert torch.equal(got, want)
    # half a step, plus the fp16 rounding (2^-11 relative) of each group's minimum and of its step times q
    slack = 2.0 ** -10 * (x.abs() + half * 2 * (2 ** bits - 1))
    assert bool(((got - x).abs() <= half + slack).all())
    assert stored.nbytes == fmt.nbytes(x.numel(), x.shape[dim % x.dim()])


@pytest.mark.parametrize("bits", [4, 8])
def test_values_on_their_groups_grid_come_back_exactly(bits):
    levels = 2 ** bits - 1
    q = torch.randint(0, levels + 1, (4, 32), generator=torch.Generator().manual_seed(1)).float()
    q[:, 0::16], q[:, 1::16] = 0, levels                              # every group spans the whole range
    x = q * 0.25 - 1.5                                                # an fp16-exact minimum and step
    fmt = GroupQuant(bits, 16)
    assert torch.equal(fmt.unpack(fmt.pack(x)), x)
    constant = torch.full((2, 16), 3.0)                               # a step of 0
    assert torch.equal(fmt.unpack(fmt.pack(constant)), constant)


def test_four_bit_packs_two_values_a_byte_and_the_bytes_are_counted():
    fmt4, fmt8 = GroupQuant(4, 64), GroupQuant(8, 64)
    x = torch.randn(10, 64)
    assert fmt4.pack(x).data.shape == (10, 32) and fmt8.pack(x).data.shape == (10, 64)
    assert fmt4.pack(x).data.dtype == torch.uint8
    # one 64-wide head: 32 + 4 bytes at 4 bits, 64 + 4 at 8, against fp16's 128
    assert fmt4.nbytes(64) == 36 and fmt8.nbytes(64) == 68 and fmt4.nbytes(640, 64) == 360
    assert fmt4.nbytes(64) / 128 <= 0.30 and fmt8.nbytes(64) / 128 <= 0.55
    assert fmt4.nbytes(70) == 2 * 36                                  # a padded last group is stored whole
    assert fmt4.pack(torch.randn(3, 70)).nbytes == fmt4.nbytes(210, 70)
    assert fmt4.name == "int4-g64"


def test_unpack_puts_the_grouped_dimension_back():
    x = torch.randn(6, 5, 8)
    fmt = GroupQuant(8, 4, dim=1)
    stored = fmt.pack(x)
    assert stored.minimum.shape == (6, 8, 2) and stored.minimum.dtype == PARAM_DTYPE
    assert fmt.unpack(stored, torch.float16).shape == (6, 5, 8)
    assert fmt.unpack(stored, torch.float16).dtype == torch.float16


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        GroupQuant(3)
    with pytest.raises(ValueError, match="group_size must be an even number"):
        GroupQuant(4, 5)
