"""Tolerances between two computations that round differently, each derived from the arithmetic's error bound
rather than tuned on one CPU (AVX2, AVX-512, MKL, oneDNN and this project's kernels sum in other orders).

Standard bounds (Higham, "Accuracy and Stability of Numerical Algorithms", 3.1 and 3.5): a sum or dot product of
n terms computed in any order in a format of unit roundoff u is within gamma(n) * sum |x_i * w_i| of the exact
value, gamma(n) = n u / (1 - n u). Two implementations are each that close to the exact value, so they are
within twice that of each other.
"""
from __future__ import annotations

import torch

EPS32 = 2.0 ** -24          # fp32 unit roundoff: one rounding moves a value by at most EPS32 * |value|
EPS16 = 2.0 ** -11          # fp16 unit roundoff (an fp16-stored value's relative error)


def gamma(n: int, u: float = EPS32) -> float:
    """gamma(n): the relative bound of n accumulated roundings (n u < 1)."""
    return n * u / (1 - n * u)


def dot_bound(x: torch.Tensor, w: torch.Tensor, u: float = EPS32, extra: int = 0) -> torch.Tensor:
    """Elementwise bound on |x @ w.T computed in two orders - each other|: 2 gamma(k + extra) |x| @ |w|.T, k the
    reduction length; `extra` roundings per term on top (a bias added, a scale multiplied, an fp16 product)."""
    k = x.shape[-1]
    return 2 * gamma(k + extra, u) * (x.double().abs() @ w.double().abs().transpose(-1, -2))


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor | float, what: str = "") -> None:
    """|got - want| <= bound elementwise (bound broadcast), with the worst ratio in the message."""
    diff = (got.double() - want.double()).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64)
    over = diff > bound
    assert not bool(over.any()), (f"{what}: {int(over.sum())} of {diff.numel()} over their bound, worst "
                                  f"|diff| / bound = {float((diff / bound.clamp(min=1e-300)).max()):.3g}")
