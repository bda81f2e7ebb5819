"""The compiled quantized-weight linear (csrc/quant_linear.cpp) against the product of the weight quant.py unpacks:
4 and 8 bits, several group sizes, k not a multiple of the group, every few-row tile shape and the buffered path.
The package's own build, the one the engine runs."""
from __future__ import annotations

import pytest
import torch

from flexgen_h2o.quant import GroupQuant
from tests.tolerances import assert_within, dot_bound


@pytest.fixture
def ext(kernel):
    """The package's build of the kernels (tests/conftest.py), which binds quant_linear."""
    return kernel.ext


def _case(bits: int, group_size: int, m: int, k: int, n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    fmt = GroupQuant(bits, group_size)
    w = fmt.pack_rows(torch.randn(n, k, generator=gen) * 0.05)
    return torch.randn(m, k, generator=gen), w, fmt.unpack_rows(w, k)


def _close(out: torch.Tensor, x: torch.Tensor, dequantized: torch.Tensor) -> None:
    ref = x.double() @ dequantized.double().T
    assert out.shape == ref.shape and out.dtype == torch.float32
    # a k-term fp32 dot product in the kernel's order, each weight dequantized with up to 2 roundings (q * step
    # + min, or one FMA) against the exact one: gamma(k + 2) sum |x_i w_i| (dot_bound's two orders: 2x that)
    assert_within(out, ref, dot_bound(x, dequantized, extra=2), "quant_linear")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [64, 32, 128])
@pytest.mark.parametrize("k", [64, 70, 576, 1536])
def test_kernel_gives_the_product_of_the_dequantized_weight(ext, bits, group_size, k):
    for n in (1, 5, 64, 577):
        x, w, dequantized = _case(bits, group_size, 100, k, n, seed=n)
        for m in (1, 2, 3, 4, 5, 6, 7, 16, 100):      # every few-row tile, then the buffered path
            xm = x[:m].contiguous()
            _close(ext.quant_linear(xm, w, k, bits, group_size), xm, dequantized)


@pytest.mark.parametrize("bits, group_size, k", [
    (8, 6, 70),          # a group_size that is not a multiple of 8: the buffered path at every m
    (4, 10, 70),         # 5 bytes a group, 7 groups: the fp16 minima and steps at odd byte offsets
    (4, 2, 13),          # the smallest group, k odd
    (8, 64, 13),         # k smaller than one group, and not a multiple of 8
])
def test_odd_groups_and_tails(ext, bits, group_size, k):
    x, w, dequantized = _case(bits, group_size, 9, k, 11)
    for m in range(1, 10):
        _close(ext.quant_linear(x[:m].contiguous(), w, k, bits, group_size), x[:m], dequantized)


@pytest.mark.parametrize("bits, group_size, k", [(4, 64, 576), (8, 32, 70), (4, 128, 1536), (8, 6, 70)])
def test_a_rows_outputs_do_not_depend_on_the_rows_beside_it(ext, bits, group_size, k):
    """The few-row tiles (dequantized in registers) and the buffered path (into L1) round every weight value the
    same way and sum in one order: batch-1 decoding and a batch agree to the bit."""
    x, w, _ = _case(bits, group_size, 40, k, 37)
    whole = ext.quant_linear(x, w, k, bits, group_size)
    for m in list(range(1, 10)) + [16, 39]:
        assert torch.equal(ext.quant_linear(x[:m].contiguous(), w, k, bits, group_size), whole[:m]), m


def test_kernel_is_the_same_on_one_thread_and_two(ext):
    x, w, _ = _case(4, 64, 50, 576, 700)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [ext.quant_linear(x[:m].contiguous(), w, 576, 4, 64) for m in (1, 50)]
        torch.set_num_threads(2)
        two = [ext.quant_linear(x[:m].contiguous(), w, 576, 4, 64) for m in (1, 50)]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_empty_shapes(ext):
    assert ext.quant_linear(torch.randn(3, 0), torch.zeros(4, 0, dtype=torch.uint8), 0, 4, 64).eq(0).all()
    assert ext.quant_linear(torch.randn(0, 64), _case(4, 64, 1, 64, 5)[1], 64, 4, 64).shape == (0, 5)


def test_bad_inputs_are_refused_by_name(ext):
    x, w, _ = _case(4, 64, 3, 70, 5)
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        ext.quant_linear(x, w, 70, 3, 64)
    with pytest.raises(RuntimeError, match="group_size must be even"):
        ext.quant_linear(x, w, 70, 4, 63)
    with pytest.raises(RuntimeError, match="float32"):
        ext.quant_linear(x.double(), w, 70, 4, 64)
    with pytest.raises(RuntimeError, match="with k = 64"):
        ext.quant_linear(x, w, 64, 4, 64)
    with pytest.raises(RuntimeError, match="uint8 rows"):
        ext.quant_linear(x, w, 70, 8, 64)                     # 8-bit rows are longer
    with pytest.raises(RuntimeError, match="uint8 rows"):
        ext.quant_linear(x, w.view(torch.int8), 70, 4, 64)
    with pytest.raises(RuntimeError, match="contiguous"):
        ext.quant_linear(torch.randn(70, 3).T, w, 70, 4, 64)
