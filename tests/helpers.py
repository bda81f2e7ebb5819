"""Test helpers: tiny random transformers models, their weights as an engine source, HF greedy references."""
from __future__ import annotations

import os
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

from flexgen_h2o.config import GenerationConfig, OffloadPolicy
from flexgen_h2o.engine import Engine
from flexgen_h2o.kv import EvictionConfig
from flexgen_h2o.kernels import build
from flexgen_h2o.models import build_layers, from_hf_config, ops
from flexgen_h2o.models.transformer import all_specs
from tests.tolerances import greedy_agreement, logit_bound

VOCAB = 128
# The engine under test runs on the CPU. FLEXGEN_H2O_TEST_DEVICE=cuda runs the same tests on a GPU, computing in
# fp32 so that they hold it to the same references (tests/test_cuda.py checks the fp16 path users run there).
TEST_DEVICE = os.environ.get("FLEXGEN_H2O_TEST_DEVICE", "cpu")
# "the same run" between placements. On the CPU, bit for bit: the reference has the same block and batch shapes,
# so every op sees the same rows in the same order wherever weights, KV and activations live (fp16 weights upcast
# exactly, fp32 KV is copied as it is). On a GPU, cpu_cache_compute runs decode attention on the host against a
# reference that ran it on the device: two fp32 kernels, within a CUDA bound, not a CPU one (this ISA-independent
# suite runs it only with FLEXGEN_H2O_TEST_DEVICE=cuda)
SAME_RUN_TOL = 0.0 if TEST_DEVICE == "cpu" else 1e-5


def tiny_hf(kind: str, seed: int = 0):
    """A random fp32 HF model whose weights are already rounded to fp16 (what our store keeps)."""
    torch.manual_seed(seed)
    if kind.startswith("opt"):
        post = kind == "opt-post"
        cfg = OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
                        max_position_embeddings=256, word_embed_proj_dim=32 if post else 64,
                        do_layer_norm_before=not post, pad_token_id=1, bos_token_id=2, eos_token_id=2)
        model = OPTForCausalLM(cfg)
    else:
        kv_heads = 4 if kind == "llama-mha" else 2
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        if kind == "llama3":
            rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                          num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=512,
                          rope_parameters=rope, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                          tie_word_embeddings=False)
        model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            # scale up so that attention is far from uniform and greedy argmax has clear winners
            p.copy_((p * (4.0 if p.dim() > 1 else 1.0)).half().float())
    return model.eval()


def weight_reader(model):
    """Engine weight source from an HF model's state dict (fp16 arrays, as a converted store holds them)."""
    cfg = from_hf_config(model.config.to_dict(), name=type(model).__name__)
    sd = model.state_dict()
    arrays = {}
    for spec in all_specs(build_layers(cfg)):
        t = sd.get(spec.hf_name, sd.get("lm_head.weight") if spec.key == "lm_head.weight" else None)
        arrays[spec.name] = t.detach().to(torch.float16).numpy()
    return cfg, arrays.__getitem__


def make_engine(model, *, offload: OffloadPolicy | None = None, eviction: EvictionConfig | None = None,
                offload_dir=None, record: bool = True, device: str = TEST_DEVICE,
                compute_dtype: torch.dtype = torch.float32) -> Engine:
    cfg, read = weight_reader(model)
    offload = offload or OffloadPolicy(kv_dtype="float32", gpu_batch_size=8)
    engine = Engine(cfg, read, offload=offload, eviction=eviction, offload_dir=offload_dir, device=device,
                    compute_dtype=compute_dtype)
    if record:
        record_step_logits(engine)
    return engine


def loaded_engine(loaded, eviction: EvictionConfig | None = None) -> Engine:
    """An engine over a converted store (loader.load_model's result), fp32 KV in GPU batches of 4, recording its
    step logits as make_engine's does."""
    engine = Engine(loaded.config, loaded.read, offload=OffloadPolicy(kv_dtype="float32", gpu_batch_size=4),
                    eviction=eviction)
    return record_step_logits(engine)


def record_step_logits(engine: Engine) -> Engine:
    """engine.step_logits: sequence id -> its logits per step (fp32, on the CPU), filled as the engine runs."""
    engine.step_logits = {}

    def keep(token, seq_ids, logits):
        for row, s in enumerate(seq_ids):
            engine.step_logits.setdefault(s, []).append(logits[row].to("cpu", torch.float32, copy=True))
    engine.on_step_logits = keep
    return engine


def random_prompts(lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompts: list[list[int]], n_new: int, pad_id: int):
    """Per prompt (run alone, no padding): generated ids and per-step logits from transformers."""
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            r = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, min_new_tokens=n_new,
                               do_sample=False, output_logits=True, return_dict_in_generate=True,
                               pad_token_id=pad_id, eos_token_id=None)
        outs.append((r.sequences[0, len(p):].tolist(), [l[0].float() for l in r.logits]))
    return outs


def cli_error(flags: list[str], capsys, tmp_path, monkeypatch) -> str:
    """run.main on opt-125m (dummy weights) with `flags`, in this process, which must refuse them as the CLI refuses
    bad input: exit status 2 and one `error:` line, before any model is loaded. Returns that line."""
    from flexgen_h2o import run
    monkeypatch.setenv("FLEXGEN_H2O_HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    try:
        status = run.main(["--model", "opt-125m", "--dummy-weights", *flags])
    except SystemExit as stop:             # argparse's errors exit from the parser
        status = stop.code
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    return err


def greedy(n: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=n, stop_at_eos=False)


def max_logit_diff(a: list, b: list) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def engine_kept(engine) -> list[list[list[list[int]]]]:
    """[attention layer in order][sequence][KV head] -> sorted kept positions, across GPU batches and tiers."""
    per_layer: dict[int, list] = {}
    for caches in engine.last_caches:
        for layer, split in caches.items():
            per_layer.setdefault(layer, [])
            for cache in split.caches:
                per_layer[layer] += cache.kept_positions()
    return [per_layer[layer] for layer in sorted(per_layer)]


def count_in_place_attention(monkeypatch) -> list:
    """A list that grows by one per decode attention over a cache's own fp16 window (KVView.compute_dtype), by
    either path: the compiled kernel (the loaded extension's decode_attention, which Kernels calls) or the torch
    ops (ops.narrow_decode_attention, which TorchKernels calls)."""
    calls: list = []
    owners = [(ops, "narrow_decode_attention")]
    ext = build.load()
    if ext is not None:
        owners.append((ext, "decode_attention"))
    for owner, name in owners:
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, real=real, **kw: calls.append(1) or real(*a, **kw))
    return calls


def engine_scores(engine) -> list:
    """[attention layer][sequence][KV head] -> {position: score} of every kept token, read from the caches' own
    score and position tensors across GPU batches and tiers."""
    per_layer: dict[int, list] = {}
    for caches in engine.last_caches:
        for layer, split in caches.items():
            for cache in split.caches:
                width = int(cache.pos.shape[-1])           # every column's slots (past its own: position -1)
                pos, score = cache.pos_window(width).to("cpu"), cache.slot_scores(width).to("cpu")
                per_layer.setdefault(layer, []).extend(
                    [{int(p): float(s) for p, s in zip(pos[b, g], score[b, g]) if p >= 0}
                     for g in range(pos.shape[1])] for b in range(pos.shape[0]))
    return [per_layer[layer] for layer in sorted(per_layer)]


def assert_scores_close(mine: list, ref: list, rel: float, sequences) -> None:
    """The caches' kept positions and scores against the reference's, for the given sequences (those whose runs
    no near tie split, tolerances.eviction_tie_step): each score within rel of the reference's
    (tolerances.score_rel_bound: two fp32 orders of the same sums)."""
    for l, (layer_a, layer_b) in enumerate(zip(mine, ref)):
        for b in sequences:
            for g, (col_a, col_b) in enumerate(zip(layer_a[b], layer_b[b])):
                assert col_a.keys() == col_b.keys(), f"layer {l} sequence {b} head {g}"
                for p in col_a:
                    assert abs(col_a[p] - col_b[p]) <= rel * abs(col_b[p]), \
                        f"layer {l} sequence {b} head {g} position {p}: score {col_a[p]} vs {col_b[p]}"


def assert_agree(model, tokens, logits, want_tokens, want_logits, bitwise: bool) -> None:
    """Two engine runs of the same prompts (per sequence tokens and step logits). bitwise: both on the compiled
    kernels on the CPU, whose every op computes a row in one order whatever its batch-mates, block cut, tier or
    prefill chunk (tests/test_batch_invariance.py), so bit for bit; else two fp32 orders: tokens equal but at a
    near tie, logits within tolerances.logit_bound (or a GPU's SAME_RUN_TOL) up to there."""
    for i in range(len(want_tokens)):
        want, got = want_logits[i], logits[i]                  # lists, or engine.step_logits' dicts
        if bitwise and TEST_DEVICE == "cpu":
            assert tokens[i] == want_tokens[i], f"sequence {i}"
            assert all(torch.equal(a, b) for a, b in zip(got, want)), f"sequence {i}"
            continue
        bound = max(logit_bound(model, torch.stack(want)), SAME_RUN_TOL)
        n = greedy_agreement(tokens[i], want_tokens[i], want, bound, f"sequence {i}")
        assert max_logit_diff(got[:n], want[:n]) <= bound, f"sequence {i}"


def assert_matches_transformers(model, lengths=(9, 14), n_new: int = 65) -> Any:
    """The engine's greedy run of random prompts against transformers' own model: the compiled kernels against
    its MKL/oneDNN GEMMs and eager attention are two fp32 orders, so tokens equal but at a near tie and logits
    within tolerances.logit_bound up to there (assert_agree). Returns the engine, for more checks."""
    prompts = random_prompts(list(lengths))
    engine = make_engine(model)
    out = engine.generate(prompts, greedy(n_new))
    refs = hf_greedy(model, prompts, n_new, pad_id=model.config.pad_token_id)
    assert all(len(engine.step_logits[i]) == n_new for i in range(len(prompts)))
    assert_agree(model, out.token_ids, engine.step_logits, [t for t, _ in refs], [l for _, l in refs], False)
    return engine


def assert_alone_equals_batch(model, prompts: list[list[int]], ev: EvictionConfig, n_new: int) -> None:
    """With the compiled kernels (batch invariance), each prompt's tokens, step logits and kept slots equal its alone
    run's bit for bit, in one padded batch and in a prompt pass of two sequences at a time."""
    alone: list = []
    for cut in ({}, {"prefill_batch_size": 2}):
        engine = make_engine(model, eviction=ev, offload=OffloadPolicy(kv_dtype="float32", gpu_batch_size=4, **cut))
        try:
            assert engine.kernels.batch_invariant
            while len(alone) < len(prompts):
                engine.step_logits = {}
                out = engine.generate([prompts[len(alone)]], greedy(n_new))
                alone.append((out.token_ids[0], engine.step_logits[0], [x[0] for x in engine_kept(engine)]))
            engine.step_logits = {}
            batch = engine.generate(prompts, greedy(n_new))
            kept = engine_kept(engine)
            for i, (tokens, logits, slots) in enumerate(alone):
                assert batch.token_ids[i] == tokens, (cut, i)
                assert all(torch.equal(a, b) for a, b in zip(engine.step_logits[i], logits)), (cut, i)
                assert [x[i] for x in kept] == slots, (cut, i)
        finally:
            engine.close()
