"""Weight reuse across GPU batches, measured: per token step the offloaded weights cross the link once for the
whole block (one model's worth of bytes), not once per GPU batch."""
from __future__ import annotations

import functools
from collections import Counter

import pytest

from flexgen_h2o.config import OffloadPolicy
from flexgen_h2o.weights.placement import is_lookup_table
from tests.helpers import greedy, make_engine, random_prompts, tiny_hf

GBS = 2
N, K = 3, 4          # runs of N and N + K new tokens: the difference is K decode steps


@functools.lru_cache(maxsize=None)
def _model(kind):
    return tiny_hf(kind)


def _model_bytes(engine, homes=("host", "disk")) -> int:
    """What stage() reads as whole tensors in one pass over the layers: every layer's specs at fp16 except
    embedding lookup tables (read by row), a tied tensor once per layer that multiplies with it, counting only
    tensors homed on `homes`."""
    return sum(s.numel * 2 for layer in engine.layers for s in layer.weight_specs()
               if engine.weights.home_of[s.name] in homes and not is_lookup_table(layer, s))


def _count_stages(engine) -> Counter:
    calls: Counter = Counter()
    stage = engine.weights.stage

    def counting(index):
        calls[index] += 1
        return stage(index)
    engine.weights.stage = counting
    return calls


def _engine(kind, pct, nb, overlap=True, sep_layer=True):
    policy = OffloadPolicy.from_percent(pct, gpu_batch_size=GBS, num_gpu_batches=nb, overlap=overlap,
                                        sep_layer=sep_layer, kv_dtype="float32")
    return make_engine(_model(kind), offload=policy, record=False)


WEIGHTS_DISK = [0, 0, 100, 0, 100, 0]      # only the weights leave the compute tier
WEIGHTS_HOST = [0, 100, 100, 0, 100, 0]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sequential"])
@pytest.mark.parametrize("nb", [1, 2, 4])
@pytest.mark.parametrize("pct, tier", [(WEIGHTS_DISK, "disk"), (WEIGHTS_HOST, "host")], ids=["disk", "host"])
def test_weights_staged_once_per_step_whatever_the_batch_count(pct, tier, nb, overlap):
    engine = _engine("opt", pct, nb, overlap)
    model_bytes = _model_bytes(engine)
    assert model_bytes == sum(engine.weights.layer_bytes(l) for l in range(len(engine.layers)))
    prompts = random_prompts([5 + b for b in range(GBS * nb)])           # one block of nb GPU batches
    calls = _count_stages(engine)

    engine.generate(prompts, greedy(N))
    after_n = Counter(engine.weights.bytes_read)
    assert set(after_n) == {tier}                                        # everything comes from that tier
    assert after_n[tier] == N * model_bytes                              # prefill + (N - 1) decode steps
    assert calls == {l: N for l in range(len(engine.layers))}            # each layer once per token step

    engine.generate(prompts, greedy(N + K))
    delta = Counter(engine.weights.bytes_read)
    delta.subtract(after_n)
    per_step = delta[tier] - N * model_bytes                             # the K extra decode steps
    assert per_step == K * model_bytes                                   # not K * nb * model_bytes
    engine.close()


def test_tied_embedding_is_streamed_once_by_the_head_and_looked_up_by_row():
    engine = _engine("opt", WEIGHTS_HOST, 2)
    distinct = sum(engine.weights.resident_bytes.values())
    per_pass = _model_bytes(engine)
    # OPT's lm_head is the embedding table: the head stages it whole; the embed layer reads rows of it and of
    # the learned-position table, which no layer multiplies with
    positions = next(s for s in engine.layers[0].weight_specs() if s.key == "embed_positions.weight")
    assert per_pass == distinct - positions.numel * 2
    engine.generate(random_prompts([4, 6, 5, 7]), greedy(N))
    assert engine.weights.bytes_read["host"] == N * per_pass


@pytest.mark.parametrize("tier, pct", [("host", WEIGHTS_HOST), ("disk", WEIGHTS_DISK)])
def test_offloaded_embedding_reads_only_the_rows_it_looks_up(tier, pct):
    nb = 2
    engine = _engine("llama-gqa", pct, nb)
    lengths = [5, 8, 3, 6]
    prompts = random_prompts(lengths)
    result = engine.generate(prompts, greedy(N))
    width = engine.model.hidden_size
    pad = engine.model.pad_id
    expected = 0
    for lo in range(0, len(prompts), GBS):                  # per GPU batch: its distinct ids of each step
        batch = range(lo, lo + GBS)
        p_len = max(lengths)                                 # one block: one padded prompt length
        prefill_ids = {pad} if any(lengths[s] < p_len for s in batch) else set()
        prefill_ids |= {t for s in batch for t in prompts[s]}
        expected += len(prefill_ids)
        for step in range(N - 1):                            # the last generated token is never fed back
            expected += len({result.token_ids[s][step] for s in batch})
    assert engine.weights.lookup_bytes == Counter({tier: expected * width * 2})
    engine.close()


@pytest.mark.parametrize("kind", ["opt-post", "llama-gqa"])
def test_reuse_with_fused_layers_and_bytes_scale_with_blocks(kind):
    # attention + MLP as one schedule layer: still one pass of weights per token step per block
    engine = _engine(kind, WEIGHTS_DISK, 2, overlap=True, sep_layer=False)
    model_bytes = _model_bytes(engine)
    one_block = random_prompts([5, 8, 3, 6])
    engine.generate(one_block, greedy(N))
    assert engine.weights.bytes_read["disk"] == N * model_bytes
    # two blocks run one after the other: each streams the model once per token step
    engine.weights.bytes_read.clear()
    engine.generate(one_block + one_block, greedy(N))
    assert engine.weights.bytes_read["disk"] == 2 * N * model_bytes
    engine.close()


@pytest.mark.parametrize("nb", [1, 4])
def test_mixed_placement_reads_only_offloaded_tensors(nb, tmp_path):
    pct = [30, 40, 20, 30, 34, 33]
    policy = OffloadPolicy.from_percent(pct, gpu_batch_size=GBS, num_gpu_batches=nb, kv_dtype="float32")
    engine = make_engine(_model("llama-gqa"), offload=policy, offload_dir=tmp_path, record=False)
    homes = set(engine.weights.home_of.values())
    assert homes == {"compute", "host", "disk"}
    engine.generate(random_prompts([4 + b for b in range(GBS * nb)]), greedy(N))
    for tier in ("host", "disk"):
        assert engine.weights.bytes_read[tier] == N * _model_bytes(engine, homes=(tier,)) > 0
    assert engine.weights.bytes_read["compute"] == 0
    engine.close()
