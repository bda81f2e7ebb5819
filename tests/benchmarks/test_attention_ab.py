"""benchmarks/studies/attention_ab.py: loading another revision's attention function, and the ratio arithmetic."""
import pytest
import torch

from benchmarks.studies.attention_ab import old_attention, ratios
from flexgen_h2o.models import ops


def test_old_revision_function_runs_and_ignores_arguments_it_does_not_know():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    mask = ops.causal_pad_mask(torch.ones(1, 5, dtype=torch.bool))
    old = old_attention("HEAD")
    out, _ = old(q, k, v, mask, 0.5, want_scores=False, an_argument_from_the_future=1)
    ref, _ = ops.grouped_attention(q, k, v, mask, 0.5)
    assert torch.allclose(out, ref)


def test_ratio_is_old_over_new_per_case():
    r = ratios({"full-old": [2.0, 4.0], "full-new": [1.5, 1.5], "h2o-old": [1.0], "h2o-new": [2.0]})
    assert r == {"full": pytest.approx(2.0), "h2o": pytest.approx(0.5)}
