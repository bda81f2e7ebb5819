"""EvictionConfig.score_window (--score-window N): the prompt pass scores each key by the attention of the last N
real prompt queries of its sequence only, on every path that scores a prompt (docs/cli.md "KV cache (H2O)"):
the torch ops and the compiled kernel (kernels/dispatch.py's table), a prompt attended alone per sequence (batch
invariance), the engine's block loop, a kept prefill and the HF cache. Checked against the masked reference of
tests/reference/h2o_masked.py with its prompt scores taken from the last N real queries only; decode steps score
as H2O does. None is H2O's rule, every real query, bit for bit."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from flexgen_h2o.config import ConfigError
from flexgen_h2o.hf import H2OCache
from flexgen_h2o.hf.attention import prompt_attention
from flexgen_h2o.kernels import build
from flexgen_h2o.kernels.dispatch import INVARIANT_SWITCH
from flexgen_h2o.kv import EvictionConfig
from flexgen_h2o.models.ops import TORCH, causal_pad_mask
from tests.helpers import (assert_alone_equals_batch, assert_scores_close, cli_error, engine_kept, engine_scores,
                           greedy, make_engine, random_prompts, tiny_hf)
from tests.reference import h2o_masked
from tests.reference.compare import (LENGTHS, N_NEW, assert_same_as_reference, check_hf_cache, run_engine,
                                     run_reference, score_bound)
from tests.tolerances import EPS32, assert_within, attention_bounds

H2O = EvictionConfig(policy="h2o", hh_size=4, recent_size=3)
WINDOW = 6           # shorter than every prompt of LENGTHS: each prompt's earlier queries stop counting
LONG_WINDOW = 16     # longer than the 13-token prompt, which then counts all its queries


def windowed(ev: EvictionConfig, n: int) -> EvictionConfig:
    return dataclasses.replace(ev, score_window=n)


def window_the_reference(monkeypatch, n: int) -> None:
    """The masked reference's prefill scores from only the last n of a sequence's real query rows (its decode
    steps pool their one query as before)."""
    pool = h2o_masked._RefState.pool

    def last_rows(self, probs, b, g, r, query_rows):
        return pool(self, probs, b, g, r, query_rows[-n:] if self.phase == "prefill" else query_rows)
    monkeypatch.setattr(h2o_masked._RefState, "pool", last_rows)


def torch_kernels(monkeypatch, path: str) -> None:
    """An engine made after this call runs its attention on the compiled kernels, each prompt alone on its own
    tokens ("compiled") or the padded batch at once ("batched"), or on the torch ops ("torch")."""
    if path == "torch":
        monkeypatch.setenv(build.OFF_SWITCH, "0")
        return
    if build.load() is None:
        pytest.skip(f"compiled kernels unavailable: {build.unavailable_reason()}")
    if path == "batched":
        monkeypatch.setenv(INVARIANT_SWITCH, "0")


# --- the engine against the reference scored by the last queries ---

@pytest.mark.parametrize("kind,window,path", [("opt", WINDOW, "compiled"), ("llama-gqa", WINDOW, "compiled"),
                                              ("llama-gqa", LONG_WINDOW, "compiled"), ("llama-gqa", WINDOW, "batched"),
                                              ("llama-gqa", WINDOW, "torch"), ("opt", LONG_WINDOW, "torch")])
def test_matches_the_windowed_reference(kind, window, path, monkeypatch):
    """Left-padded batch, fp32 KV: tokens (but at a near tie), logits within logit_bound, and for the runs no near
    tie split, the kept slots and their scores; and the window really changed what the prompt pass kept."""
    torch_kernels(monkeypatch, path)
    model = tiny_hf(kind)
    prompts = random_prompts(LENGTHS)
    ev = windowed(H2O, window)
    engine, out = run_engine(model, prompts, ev)
    try:
        with monkeypatch.context() as m:
            window_the_reference(m, window)
            trace, scores, evd = [], [], {}
            ref_tokens, ref_logits = run_reference(model, prompts, ev, trace=trace, scores=scores, eviction=evd)
        whole = assert_same_as_reference(model, engine, out, ref_tokens, ref_logits, evd)
        assert whole, "every sequence split at a near tie: no kept slots left to compare"
        kept = engine_kept(engine)
        assert [[x[i] for i in whole] for x in kept] == [[x[i] for i in whole] for x in trace[-1]]
        assert_scores_close(engine_scores(engine), scores, score_bound(model, ref_tokens, evd), whole)
    finally:
        engine.close()
    every: list = []
    run_reference(model, prompts, H2O, trace=every)
    assert every[0] != trace[0], "the window kept the same prompt tokens as every query: the test shows nothing"


# --- the torch ops against the compiled kernel ---

@pytest.mark.parametrize("reduce", ["sum", "mean"])
@pytest.mark.parametrize("pads", [(0, 30, 141), (0, 0, 0)], ids=["padded", "unpadded"])
def test_kernel_matches_the_torch_ops(kernel, pads, reduce):
    """Scores from the last `window` rows, within attention_bounds of each other and of the plain sum in double
    over exactly those queries. 150 queries: the kernel's two query blocks and the torch ops' blocks of 32 each
    start before the window, which begins inside one; the 9-token prompt is shorter than the window."""
    torch.manual_seed(0)
    b, h, g, t, d, window = 3, 4, 2, 150, 16, 40
    q, k, v = torch.randn(b, h, t, d) * 2, torch.randn(b, g, t, d) * 2, torch.randn(b, g, t, d)
    valid = torch.arange(t)[None, :] >= torch.tensor(pads)[:, None]
    unpadded, scale, r = not pads[-1], d ** -0.5, h // g
    out, mass = kernel.scored_prompt_attention(q, k, v, valid, unpadded, scale, reduce, 256, score_window=window)
    ref_out, ref_mass = TORCH.scored_prompt_attention(q, k, v, valid, unpadded, scale, reduce, 32,
                                                      score_window=window)
    counted = valid & (torch.arange(t) >= t - window)
    out_bound, mass_bound = attention_bounds(q, k, v, causal_pad_mask(valid), scale, counted)
    if reduce == "mean":
        mass_bound = mass_bound / r * (1 + 2 * EPS32)
    assert_within(out, ref_out, out_bound, "output")
    assert_within(mass, ref_mass, mass_bound, "kernel vs torch mass")
    # the plain definition: probabilities in double, summed over the counted queries and the group's heads
    logits = (q.double() @ k.double().repeat_interleave(r, 1).transpose(-1, -2)) * scale
    probs = torch.softmax(logits.masked_fill(~causal_pad_mask(valid), float("-inf")), -1)
    plain = (probs * counted[:, None, :, None]).sum(2).view(b, g, r, t).sum(2) / (r if reduce == "mean" else 1)
    assert_within(mass, plain, mass_bound, "kernel vs plain mass")
    assert_within(ref_mass, plain, mass_bound, "torch vs plain mass")
    every = TORCH.scored_prompt_attention(q, k, v, valid, unpadded, scale, reduce, 32)[1]
    assert not torch.allclose(every, ref_mass), "every query's mass equals the window's: the test shows nothing"


# --- batch invariance ---

def test_a_prompt_alone_and_in_a_padded_batch_bit_for_bit(kernel):
    """With the compiled kernels each prompt attends alone on its own tokens (models/per_sequence.py), so its
    window is the last rows of its own tokens whatever its padding: tokens, logits and kept slots equal bit for
    bit, in one padded batch and in a prompt pass of two sequences at a time. The 5-token prompt is shorter than
    the window."""
    ev = EvictionConfig(policy="h2o", hh_ratio=0.2, score_window=8)
    assert_alone_equals_batch(tiny_hf("llama-gqa"), random_prompts([5, 31, 12, 24]), ev, N_NEW)


# --- None is H2O's rule ---

@pytest.mark.parametrize("path", ["compiled", "torch"])
def test_none_and_a_covering_window_are_every_query(path, monkeypatch):
    """None is the default; a window as long as the longest prompt counts every query: the run is the windowless
    one bit for bit (the same sums in the same order), scores included."""
    assert EvictionConfig(policy="h2o", hh_size=4, recent_size=3, score_window=None) == H2O
    torch_kernels(monkeypatch, path)
    model = tiny_hf("llama-gqa")
    prompts = random_prompts(LENGTHS)
    runs = [run_engine(model, prompts, ev) for ev in (H2O, windowed(H2O, max(LENGTHS)))]
    try:
        (a, out_a), (b, out_b) = runs
        assert out_a.token_ids == out_b.token_ids
        assert all(torch.equal(x, y) for i in a.step_logits for x, y in zip(a.step_logits[i], b.step_logits[i]))
        assert engine_scores(a) == engine_scores(b)
    finally:
        for engine, _ in runs:
            engine.close()


# --- a kept prefill ---

def test_a_prefill_keeps_its_window(kernel):
    """Engine.prefill records its score_window; a rule with another window is refused, one with the same one
    decodes as its own run does."""
    model = tiny_hf("llama-gqa")
    prompts = random_prompts(LENGTHS)
    ev = windowed(H2O, WINDOW)
    engine = make_engine(model)
    try:
        with pytest.raises(ConfigError, match="score_window None"):
            engine.generate(prompts, greedy(N_NEW), eviction=ev, prefilled=engine.prefill(prompts))
        pre = engine.prefill(prompts, score_window=WINDOW)
        with pytest.raises(ConfigError, match=f"score_window {WINDOW}"):
            engine.generate(prompts, greedy(N_NEW), eviction=H2O, prefilled=pre)
        engine.step_logits = {}
        kept = engine.generate(prompts, greedy(N_NEW), eviction=ev, prefilled=pre)
        kept_slots = engine_kept(engine)
        engine.step_logits = {}
        own = engine.generate(prompts, greedy(N_NEW), eviction=ev)
        assert kept.token_ids == own.token_ids
        assert kept_slots == engine_kept(engine)
        # a rule that ranks by no score decodes from any prefill
        engine.generate(prompts, greedy(2), eviction=EvictionConfig(policy="local", recent_size=7), prefilled=pre)
    finally:
        engine.close()


# --- the HF cache ---

@pytest.mark.parametrize("kind", ["opt", "llama-gqa"])
def test_hf_cache_keeps_what_the_engine_keeps(kind):
    """H2OCache(score_window=...) in transformers' generate, left-padded: the engine's tokens and kept slots."""
    check_hf_cache(kind, H2OCache(hh_size=4, recent_size=3, score_window=WINDOW), windowed(H2O, WINDOW))


def test_hf_refuses_a_window_over_right_padding():
    q = k = v = torch.zeros(1, 2, 4, 8)
    right = torch.tensor([[True, True, True, False]])
    with pytest.raises(ValueError, match="pad prompts on the left"):
        prompt_attention(q, k, v, right, 1.0, want_scores=True, score_window=2)


# --- the request and the CLI ---

@pytest.mark.parametrize("fields,message", [
    (dict(policy="h2o", hh_size=4, score_window=0), "must be an integer >= 1"),
    (dict(policy="h2o", hh_size=4, score_window=2.5), "must be an integer >= 1"),
    (dict(policy="full", score_window=8), "drop score_window"),
    (dict(policy="local", recent_size=8, score_window=8), "does not rank keys by attention"),
    (dict(policy="h2o-avg", hh_size=4, score_window=8), "divides each key's mass by every query"),
])
def test_refused_requests(fields, message):
    with pytest.raises(ValueError, match=message):
        EvictionConfig(**fields)


def test_the_request_names_its_window():
    assert "score_window=32" in EvictionConfig(policy="h2o", hh_ratio=0.2, score_window=32).describe_request()
    assert "score_window" not in H2O.describe_request()
    assert EvictionConfig(policy="h2o-port", hh_size=4, recent_size=3, score_window=8).score_window == 8


@pytest.mark.parametrize("flags,message", [
    (["--score-window", "0", "--hh-ratio", "0.2"], "--score-window: must be >= 1"),
    (["--score-window", "x", "--hh-ratio", "0.2"], "--score-window: expected an integer"),
    (["--score-window", "8"], "--score-window ranks the prompt tokens an eviction keeps: it needs a KV budget"),
    (["--score-window", "8", "--full-cache"], "it needs a KV budget"),
    (["--score-window", "8", "--policy", "local", "--hh-ratio", "0.2"], "does not rank keys by attention"),
    (["--score-window", "8", "--h2o-variant", "avg", "--hh-ratio", "0.2"], "divides each key's mass"),
])
def test_cli_refuses_a_bad_window(flags, message, capsys, tmp_path, monkeypatch):
    err = cli_error(flags, capsys, tmp_path, monkeypatch)
    assert message in err, err


def test_a_batch_job_records_its_window():
    """The window changes the answers: a resume with another --score-window is refused by the settings record
    (docs/cli.md, "What is guaranteed"); a full cache scores nothing, so its record has no window."""
    from flexgen_h2o.frontends.cli import build_parser
    from flexgen_h2o.frontends.settings import answer_settings

    def record(*flags: str) -> dict:
        return answer_settings(build_parser().parse_args(["--model", "opt-125m", *flags]), 8)
    assert record("--hh-ratio", "0.2", "--score-window", "8")["score_window"] == 8
    assert record("--hh-ratio", "0.2")["score_window"] is None
    assert record("--hh-ratio", "0.2", "--score-window", "8") != record("--hh-ratio", "0.2", "--score-window", "4")
