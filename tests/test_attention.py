"""ops.grouped_attention's prompt fast paths against plain masked softmax attention, with and without pads."""
from __future__ import annotations

import pytest
import torch

from flexgen_h2o.models import ops
from tests.tolerances import assert_within, attention_bounds


def naive(q, k, v, mask, scale, query_valid):
    """Repeat the KV heads, masked softmax over every key, column sums of the valid queries' probabilities."""
    r = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    logits = (q @ kr.transpose(-1, -2)) * scale
    probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)          # (b, h, t, s)
    mass = (probs * query_valid[:, None, :, None]).sum(2)                            # (b, h, s)
    return probs @ vr, mass.view(k.shape[0], k.shape[1], r, -1).sum(2)


@pytest.mark.parametrize("pads", [False, True])
@pytest.mark.parametrize("want_scores", [False, True])
def test_prompt_attention_matches_masked_softmax(pads, want_scores):
    torch.manual_seed(0)
    b, h, g, t, d = 2, 6, 2, 37, 8
    q, k, v = torch.randn(b, h, t, d), torch.randn(b, g, t, d), torch.randn(b, g, t, d)
    valid = torch.ones(b, t, dtype=torch.bool)
    if pads:
        valid[1, :5] = False                    # left padding on the second sequence
    mask = ops.causal_pad_mask(valid)
    # unpadded: the caller's causal_only lets the fused kernel use is_causal and the scores path mask only each
    # chunk's diagonal block (several chunks here)
    out, scores = ops.grouped_attention(q, k, v, mask, 0.3, want_scores=want_scores, query_valid=valid,
                                        query_chunk=16, causal_only=not pads)
    ref_out, ref_scores = naive(q, k, v, mask, 0.3, valid)
    rows = valid[:, None, :, None].expand_as(out)            # a pad query's output is never used
    out_bound, score_bound = attention_bounds(q, k, v, mask, 0.3, valid)   # two fp32 orders (fused, chunked)
    assert_within(out[rows], ref_out[rows], out_bound[rows], "out")
    if want_scores:
        assert_within(scores, ref_scores, score_bound, "scores")
        assert torch.all(scores[1, :, :5] == 0) == pads      # pad keys get no mass
    else:
        assert scores is None


@pytest.mark.parametrize("lengths, invariant, causal", [([9, 9], "1", True), ([9, 14], "0", False),
                                                      ([9, 14], "1", True)])
def test_engine_takes_the_causal_path_only_for_unpadded_prompts(monkeypatch, lengths, invariant, causal):
    """A padded batch takes the masked path, unless batch-invariant kernels attend each sequence on its own
    tokens alone (ops.per_sequence_attention): then every prompt call is causal and unpadded."""
    from tests.helpers import greedy, make_engine, random_prompts, tiny_hf
    seen = []
    real = ops.grouped_attention

    def spy(q, k, v, mask, scale, **kw):
        if q.shape[2] > 1:                                   # prompt passes only; decode steps have one query
            seen.append(kw["causal_only"])
        return real(q, k, v, mask, scale, **kw)

    monkeypatch.setattr(ops, "grouped_attention", spy)
    monkeypatch.setenv("FLEXGEN_H2O_BATCH_INVARIANT", invariant)
    engine = make_engine(tiny_hf("llama-gqa"))
    if invariant == "1" and not engine.kernels.batch_invariant:
        pytest.skip("the compiled kernels are not loaded")
    engine.generate(random_prompts(lengths), greedy(2))
    assert seen and set(seen) == {causal}


@pytest.mark.parametrize("pads", [False, True])
def test_scored_blocks_stay_under_the_byte_cap_and_match(monkeypatch, pads):
    """A cap smaller than one sequence's smallest block splits the batch by sequences and shrinks the query
    blocks; the result is still plain masked softmax attention, and no block's logits exceed the cap."""
    torch.manual_seed(1)
    b, h, g, t, d = 3, 4, 2, 40, 8
    q, k, v = torch.randn(b, h, t, d), torch.randn(b, g, t, d), torch.randn(b, g, t, d)
    valid = torch.ones(b, t, dtype=torch.bool)
    if pads:
        valid[2, :7] = False
    mask = ops.causal_pad_mask(valid)
    monkeypatch.setattr(ops, "MIN_QUERY_CHUNK", 8)
    cap = h * t * 4 * ops.MIN_QUERY_CHUNK               # one sequence's smallest block: two would not fit
    monkeypatch.setattr(ops, "SCORE_BLOCK_BYTES", cap)
    seen = []
    real_softmax = torch.softmax

    def spy(x, dim, **kw):
        seen.append(x.numel() * 4)
        return real_softmax(x, dim=dim, **kw)

    monkeypatch.setattr(ops.torch, "softmax", spy)
    out, scores = ops.grouped_attention(q, k, v, mask, 0.3, want_scores=True, query_valid=valid, query_chunk=256,
                                        causal_only=not pads)
    monkeypatch.undo()
    ref_out, ref_scores = naive(q, k, v, mask, 0.3, valid)
    rows = valid[:, None, :, None].expand_as(out)
    out_bound, score_bound = attention_bounds(q, k, v, mask, 0.3, valid)
    assert_within(out[rows], ref_out[rows], out_bound[rows], "out")
    assert_within(scores, ref_scores, score_bound, "scores")
    assert len(seen) > b and max(seen) <= cap            # several blocks, each under the cap


@pytest.mark.parametrize("cap_blocks", [0, 1, 2], ids=["no-split", "one-sequence", "two-sequences"])
def test_score_block_bytes_is_the_largest_block_made(monkeypatch, cap_blocks):
    """The planner's workspace estimate uses ops.score_block_bytes: it must be the largest logits block the
    scored pass really makes (equal when the prompt fills its last query block), whether the sequences are
    split (a cap of one or two sequences' smallest blocks, with a ragged last group) or not (no cap)."""
    torch.manual_seed(2)
    b, h, g, t, d = 3, 4, 2, 64, 8
    monkeypatch.setattr(ops, "MIN_QUERY_CHUNK", 8)
    monkeypatch.setattr(ops, "SCORE_BLOCK_BYTES", cap_blocks * h * t * 4 * 8 if cap_blocks else 1 << 40)
    q, k, v = torch.randn(b, h, t, d), torch.randn(b, g, t, d), torch.randn(b, g, t, d)
    mask = ops.causal_pad_mask(torch.ones(b, t, dtype=torch.bool))
    expected = ops.score_block_bytes(b, h, t, 256, "cpu")
    seen = []
    real_softmax = torch.softmax
    monkeypatch.setattr(ops.torch, "softmax",
                        lambda x, dim, **kw: seen.append(x.numel() * 4) or real_softmax(x, dim=dim, **kw))
    ops.grouped_attention(q, k, v, mask, 0.3, want_scores=True, query_chunk=256, causal_only=True)
    monkeypatch.undo()
    assert max(seen) == expected
    assert expected == {0: b * h * t * t * 4, 1: h * 8 * t * 4, 2: 2 * h * 8 * t * 4}[cap_blocks]
    assert ops.score_block_bytes(b, h, t, 256, "cuda") == b * h * t * t * 4    # no cap on a GPU


def test_the_layer_calls_one_kernels_method_per_phase(monkeypatch):
    """AttentionLayer.forward hands each phase to one entry point of the engine's Kernels, which chose its paths
    when it was resolved: prompt_attention for the prompt, decode_attention for every decode step."""
    from flexgen_h2o.kv import EvictionConfig
    from tests.helpers import greedy, make_engine, random_prompts, tiny_hf
    model = tiny_hf("llama-gqa")
    engine = make_engine(model, eviction=EvictionConfig(policy="h2o", hh_size=3, recent_size=2))
    calls = []
    for name in ("prompt_attention", "decode_attention", "scored_prompt_attention", "window_attention",
                 "narrow_decode_attention"):
        real = getattr(engine.kernels, name)
        monkeypatch.setattr(engine.kernels, name, lambda *a, real=real, name=name, **kw: calls.append(name)
                            or real(*a, **kw))
    engine.generate(random_prompts([9, 6]), greedy(3))
    entry = [name for name in calls if name in ("prompt_attention", "decode_attention")]
    layers = model.config.num_hidden_layers
    assert entry == ["prompt_attention"] * layers + ["decode_attention"] * 2 * layers
    # each entry point went on to the one device-level path its phase takes here
    assert calls.count("scored_prompt_attention") >= layers
    assert calls.count("window_attention") + calls.count("narrow_decode_attention") == 2 * layers
