"""The compiled fp16-weight linear (csrc/half_linear.cpp, the extension's half_linear) against the product of the
upcast weight, and kernels.Kernels.linear's dispatch to it (decode-sized row counts on a CPU) and to oneDNN's GEMM
(a prompt's rows)."""
from __future__ import annotations

import pytest
import torch

from flexgen_h2o.kernels import Kernels, build, dispatch, resolve
from flexgen_h2o.models import ops
from tests.tolerances import EPS16, assert_within, linear_bound


def _pair(m: int, k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen), (torch.randn(n, k, generator=gen) * 0.05).half()


@pytest.mark.parametrize("m, k, n", [
    (120, 576, 1536),     # SmolLM2's gate/up projection at the s2048 batch
    (120, 1536, 576),     # its down projection: x blocked by rows to stay in L2
    (1, 64, 5),           # one row, one partial weight tile
    (7, 13, 9),           # k not a multiple of 8, row and column tiles cut at both edges
    (200, 1536, 10),      # several row blocks and a partial tile
    (11, 1200, 33),       # three row tiles and a partial one of 2; eight weight tiles and a partial one of 1
    (4, 8, 16),           # k of one vector: no tail
    (3, 0, 5),            # no k: zeros, as torch gives
    (2, 13, 9),           # the few-row path (weight converted in registers): two rows, a k tail, a partial tile
    (3, 576, 1537),       # three rows, one weight row past the last tile of four
    (6, 1536, 7),         # six rows against a partial tile of two
    (5, 40, 3),           # five rows, fewer weight rows than one tile
])
def test_kernel_gives_the_product_of_the_upcast_weight(kernel, m, k, n):
    x, w = _pair(m, k, n)
    out = kernel.ext.half_linear(x, w)
    ref = x.double() @ w.double().T
    assert out.shape == (m, n) and out.dtype == torch.float32
    # the kernel's k-term fp32 sum against the exact one (an fp16 weight upcasts exactly)
    assert_within(out, ref, linear_bound(x, w), f"{m}x{k}x{n}")


def test_kernel_is_the_same_on_one_thread_and_two(kernel):
    """Every output is one thread's whole dot product, so the split changes nothing."""
    x, w = _pair(50, 96, 70)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.ext.half_linear(x, w)
        torch.set_num_threads(2)
        two = kernel.ext.half_linear(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize("k", [576, 1536, 13])
def test_a_rows_outputs_do_not_depend_on_the_rows_beside_it(kernel, k):
    """Every path (few rows, converted in registers; more rows, converted into L1) sums each dot product in one
    order, so a sequence's outputs are the same bits at any batch size: batch-1 decoding and a batch agree."""
    x, w = _pair(40, k, 37)
    whole = kernel.ext.half_linear(x, w)
    for m in list(range(1, 10)) + [16, 39]:
        assert torch.equal(kernel.ext.half_linear(x[:m].contiguous(), w), whole[:m]), m


def test_bad_inputs_are_refused_by_name(kernel, monkeypatch):
    x, w = _pair(3, 8, 4)
    with pytest.raises(RuntimeError, match="float16"):
        kernel.ext.half_linear(x, w.float())
    with pytest.raises(RuntimeError, match="float32"):
        kernel.ext.half_linear(x.double(), w)
    calls = []
    real = kernel.ext.half_linear
    monkeypatch.setattr(kernel.ext, "half_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    want = torch.nn.functional.linear(x, w.float())
    assert_within(kernel.linear(x, w.float()), want, linear_bound(x, w), "an fp32 weight")
    # fp16 x: the input rounded to fp16, the sum in fp16 at worst (or fp32), the output rounded to fp16: fp16's
    # gamma(k + 2) of sum |x w| (2x: the fp32 `want` is well inside it)
    assert_within(kernel.linear(x.half(), w), want, linear_bound(x, w, u=EPS16, extra=2), "fp16 x")
    x4 = torch.randn(3, 4)
    assert_within(kernel.linear(x4, w.T), x4 @ w.float(), linear_bound(x4, w.T), "a transposed view")
    assert not calls                                                # none of them is fp32 x by (n, k) fp16 rows


@pytest.mark.parametrize("invariant", [False, True])
def test_linear_sends_decode_rows_to_the_kernel_and_prompt_rows_to_the_blas(kernel, monkeypatch, invariant):
    """Without batch invariance a prompt's rows go to the BLAS, which is faster there; with it every row count
    goes to the kernel, whose sums for a row do not depend on the rows beside it (gemm_tile.h)."""
    calls = []
    real = kernel.ext.half_linear
    monkeypatch.setattr(kernel.ext, "half_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    kernels = Kernels(kernel.ext, batch_invariant=invariant)
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(40, 24, generator=gen) * 0.1).half()
    bias = torch.randn(40, generator=gen).half()
    sizes = (1, dispatch.HALF_LINEAR_MAX_ROWS, dispatch.HALF_LINEAR_MAX_ROWS + 1)
    for rows in sizes:
        x = torch.randn(rows, 1, 24, generator=gen)
        out = kernels.linear(x, w, bias)
        assert_within(out, torch.nn.functional.linear(x, w.float(), bias.float()), linear_bound(x, w, bias),
                      f"{rows} rows")
    assert calls == (list(sizes) if invariant else [1, dispatch.HALF_LINEAR_MAX_ROWS])
    monkeypatch.setenv(build.OFF_SWITCH, "0")
    off = resolve()                                                  # the switch is read when the kernels resolve
    assert off.ext is None
    calls.clear()
    off.linear(torch.randn(2, 24), w)
    Kernels(None).linear(torch.randn(2, 24), w)
    assert not calls


def test_prompt_rows_take_onednn_and_match_torch(monkeypatch):
    """A prompt's many fp32 rows go through oneDNN's GEMM (Kernels._gemm, the op checked once by
    dispatch.onednn_gemm()); the product equals torch's own (MKL) to fp32 rounding, for an fp32 weight, an fp16
    weight upcast whole, and one upcast in chunks; a decode step's few rows never take it, nor does gemm="blas"."""
    if dispatch.onednn_gemm() is None:
        pytest.skip("this torch has no oneDNN linear")
    calls = []
    real = dispatch.onednn_gemm()
    monkeypatch.setitem(dispatch._onednn, "op", lambda *a: calls.append(a[0].shape) or real(*a))
    kernels = Kernels(None, gemm="onednn")                          # the GEMM's choice needs no compiled build
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 512, 64, generator=gen)                      # 1024 rows: a prompt's
    w = torch.randn(96, 64, generator=gen) * 0.05
    b = torch.randn(96, generator=gen)
    # oneDNN's and MKL's fp32 sums in their own orders (the ISA's blocking): within linear_bound of each other
    assert_within(kernels.linear(x, w, b), torch.nn.functional.linear(x, w, b), linear_bound(x, w, b), "fp32 w")
    wh = w.half()
    assert_within(kernels.linear(x, wh), x @ wh.float().T, linear_bound(x, wh), "fp16 w")
    monkeypatch.setattr(ops, "UPCAST_CHUNK_BYTES", 64 * 4 * 32)        # three chunks of 32 weight rows
    assert_within(kernels.linear(x, wh), x @ wh.float().T, linear_bound(x, wh), "fp16 w in chunks")
    assert len(calls) == 5
    kernels.linear(x[:1, :4], w)                                      # a decode step: torch's path
    Kernels(None, gemm="blas").linear(x, w, b)                        # FLEXGEN_H2O_CPU_GEMM=blas: MKL's
    assert len(calls) == 5
