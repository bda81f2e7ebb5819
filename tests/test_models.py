"""The engine's OPT and Llama math against transformers' own models: prefill + 64 decode steps, fp32."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import greedy, make_engine, random_prompts, tiny_hf
from tests.helpers import assert_agree, assert_matches_transformers
from tests.tolerances import assert_within, linear_bound

KINDS = ["opt", "opt-post", "llama-mha", "llama-gqa", "llama3"]
N_NEW = 65          # the prefill step's logits + 64 decode steps


@pytest.mark.parametrize("kind", KINDS)
def test_logits_and_tokens_match_transformers(kind):
    assert_matches_transformers(tiny_hf(kind), n_new=N_NEW)


@pytest.mark.parametrize("kind", ["opt", "llama-gqa"])
def test_padding_changes_nothing(kind):
    model = tiny_hf(kind)
    prompts = random_prompts([3, 11, 7, 16])
    batched = make_engine(model)
    together = batched.generate(prompts, greedy(12))
    for i, p in enumerate(prompts):
        alone = make_engine(model)
        single = alone.generate([p], greedy(12))
        # bit for bit with the compiled kernels (row-invariant, each prompt attends on its own tokens); else
        # the batch's shape picks other GEMM blockings: logit_bound, tokens parting only at a near tie
        assert_agree(model, [together.token_ids[i]], [batched.step_logits[i]], [single.token_ids[0]],
                     [alone.step_logits[0]], batched.kernels.batch_invariant)


def test_rope_llama3_scaling_differs_from_default():
    # the llama3 model really uses its scaled frequencies: a default-RoPE twin gives other logits
    from flexgen_h2o.models import ops
    scaled = ops.rope_inv_freq(16, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    plain = ops.rope_inv_freq(16, 500000.0)
    assert not torch.allclose(scaled, plain)
    assert torch.allclose(scaled[0], plain[0])            # the highest frequency is untouched
    assert torch.allclose(scaled[-1], plain[-1] / 8.0)    # the lowest is divided by the factor


def test_metrics_over_several_blocks():
    # 5 prompts in blocks of 2: counts add up over blocks, the block shape is the last block's (not a sum)
    from flexgen_h2o.config import OffloadPolicy
    model = tiny_hf("llama-gqa")
    engine = make_engine(model, offload=OffloadPolicy(kv_dtype="float32", gpu_batch_size=2), record=False)
    out = engine.generate(random_prompts([4, 6, 5, 9, 7]), greedy(5))
    m = out.metrics
    assert m["generated_tokens"] == 25 and m["decode_steps"] == 3 * 4
    assert m["block_size"] == 1 and m["padded_prompt_len"] == 7
    assert len(m["step_times_s"]) == 4 and all(t > 0 for t in m["step_times_s"])


@pytest.mark.parametrize("chunk_bytes", [64 << 10, 8 << 20])
def test_linear_upcasts_fp16_weights_by_row_blocks(monkeypatch, chunk_bytes):
    """ops.linear with a weight stored narrower than x (fp16 staged on a CPU) equals the linear on the upcast
    weight: every block of rows is an fp32 GEMM on the same (exactly upcast) values, of another shape, so the
    BLAS may block its sums otherwise: within tolerances.linear_bound. 64 KiB blocks cut a 3000-row weight
    into 375 blocks (the last one partial); the default 8 MiB into 3."""
    import torch.nn.functional as F

    from flexgen_h2o.models import ops
    monkeypatch.setattr(ops, "UPCAST_CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(ops._local, "scratch", None, raising=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 2048, generator=g)
    w = (torch.randn(3000, 2048, generator=g) * 0.02).half()
    b = torch.randn(3000, generator=g)
    want = F.linear(x, w.float(), b)
    got = ops.linear(x, w, b)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert_within(got, want, linear_bound(x, w, b), "row blocks")
    assert torch.equal(ops.linear(x, w.float(), b), want)        # same dtype: the plain kernel
