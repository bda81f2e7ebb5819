"""Page selection (`--kv-select pages`, kv/pages.py): a cache that keeps every token, each decode step reading only
the pages its query needs. Against the plain masked reference (tests/reference/pages_masked.py): the same pages
every step and the same tokens and logits, on OPT, Llama MHA and GQA, every tier and split, the compiled kernels
and the torch ops; a budget holding every page is the full cache bit for bit; alone = in a batch; the bytes a
step reads, from the engine's counters and from the OS for the disk tier; the flags."""
from __future__ import annotations

import os

import pytest
import torch

from benchmarks.machine import proc_read_bytes
from flexgen_h2o.config import OffloadPolicy
from flexgen_h2o.kernels import build
from flexgen_h2o.kv import EvictionConfig
from flexgen_h2o.kv.page_rule import PageRule
from flexgen_h2o.kv.pages import PagedKVCache, choose_pages, page_bounds
from tests.helpers import (assert_alone_equals_batch, cli_error, greedy, make_engine, random_prompts, tiny_hf)
from tests.reference.compare import LENGTHS, N_NEW, PLACEMENTS, all_caches, left_padded, same_run
from tests.reference.pages_masked import page_reference_generate

KINDS = ["opt", "llama-mha", "llama-gqa"]
# 4-token pages: the prompts (13-24 tokens) have 4-6 pages and grow to 8-10; a step reads 4 of them, or 30 %
RULES = {"pages-4": PageRule(page_size=4, fetch_pages=4, score="bound"),
         "ratio-0.3": PageRule(page_size=4, fetch_ratio=0.3, score="bound"),
         "sinkless": PageRule(page_size=3, fetch_pages=3, sink_pages=0, recent_pages=1, score="bound"),
         "dense-first": PageRule(page_size=4, fetch_pages=4, dense_layers=1, score="bound"),
         "keys": PageRule(page_size=4, fetch_pages=4), "keys-ratio": PageRule(page_size=3, fetch_ratio=0.3),
         "ahead": PageRule(page_size=4, fetch_pages=4, ahead=True)}


def fp32(**kw) -> OffloadPolicy:
    return OffloadPolicy(kv_dtype="float32", gpu_batch_size=len(LENGTHS), **kw)


def engine_pages(engine) -> dict[int, list]:
    """Per attention layer that selects (by its place among the attention layers): per decode step, [b][g] ->
    sorted pages read, from the caches' logs."""
    per_layer: dict[int, list] = {}
    for caches in engine.last_caches:
        for layer, split in caches.items():
            if not isinstance(split.caches[0], PagedKVCache):
                continue
            steps = None
            for cache in split.caches:
                part = [[[sorted(p for p in col.tolist() if p >= 0) for col in row] for row in step]
                        for step in cache.page_log]
                steps = part if steps is None else [a + b for a, b in zip(steps, part)]
            per_layer.setdefault(layer, []).append(steps)
    order = sorted(engine.last_caches[0])
    return {order.index(layer): [sum((batch[s] for batch in per_layer[layer]), []) for s in
                                 range(len(per_layer[layer][0]))] for layer in sorted(per_layer)}


def check_against_reference(kind: str, rule: PageRule, monkeypatch, **engine_kw) -> dict:
    """Engine and reference on the same padded prompts: the pages read at every step of every layer, and the
    tokens and logits (two fp32 orders: equal but at a near tie, tolerances.logit_bound). Returns the pages."""
    monkeypatch.setattr(PagedKVCache, "record_pages", True)
    model = tiny_hf(kind)
    prompts = random_prompts(LENGTHS)
    engine = make_engine(model, eviction=EvictionConfig(pages=rule), **{"offload": fp32(), **engine_kw})
    try:
        out = engine.generate(prompts, greedy(N_NEW))
        for caches in engine.last_caches:           # the first dense_layers read every page of a plain cache
            assert [all(isinstance(c, PagedKVCache) for c in caches[l].caches) for l in sorted(caches)] == \
                [i >= rule.dense_layers for i in range(len(caches))]
        mine = engine_pages(engine)
        logits = [engine.step_logits[i] for i in range(len(prompts))]
    finally:
        engine.close()
    ids, mask = left_padded(model, prompts)
    want = dict(page_size=rule.page_size, fetch_ratio=rule.fetch_ratio, fetch_pages=rule.fetch_pages,
                sink_pages=rule.sink_pages, recent_pages=rule.recent_pages, dense_layers=rule.dense_layers,
                score=rule.score, ahead=rule.ahead)
    tokens, ref_logits, ref_pages = page_reference_generate(model, ids, mask, want, N_NEW)
    steps = same_run(model, out.token_ids, tokens.tolist(), logits, ref_logits)
    assert steps == [N_NEW] * len(prompts)
    assert mine == ref_pages
    return mine


# --- the rule ---

def test_pages_read_counts():
    rule = PageRule(page_size=32, fetch_ratio=0.2)
    assert rule.pages_read(2049) == 13              # int(0.2 * 2049) = 409 tokens: 13 pages of 65
    assert rule.pages_read(40) == 2 and rule.pages_read(100) == 3      # at least the sink and recent pages
    assert PageRule(page_size=32, fetch_pages=100).pages_read(2049) == 65
    with pytest.raises(ValueError, match="exactly one"):
        PageRule(fetch_ratio=0.2, fetch_pages=4)
    with pytest.raises(ValueError, match="fetch_ratio"):
        PageRule(fetch_ratio=1.5)


def test_the_bound_is_quests():
    """Two products equal the elementwise sum_c max(q_c * lo_c, q_c * hi_c), largest over the group's heads, and
    no key of a page scores above its bound."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 4, 8, generator=g)
    keys = torch.randn(2, 3, 5, 6, 8, generator=g)                  # (b, g, page, token, d)
    lo, hi = keys.amin(dim=3), keys.amax(dim=3)
    plain = torch.maximum(q[:, :, :, None] * lo[:, :, None], q[:, :, :, None] * hi[:, :, None]).sum(-1).amax(2)
    summary = torch.cat((hi, lo), dim=-1)
    assert torch.allclose(page_bounds(q, summary), plain, rtol=1e-5, atol=1e-5)
    logits = torch.einsum("bgrd,bgptd->bgrpt", q, keys).amax(dim=(2, 4))
    assert bool((logits <= page_bounds(q, summary) + 1e-5).all())


def test_choose_pages_forces_sink_and_recent():
    rule = PageRule(page_size=4, fetch_pages=4, sink_pages=1, recent_pages=2)
    bounds = torch.tensor([[[0.0, 5.0, 1.0, 9.0, 2.0, 3.0, 7.0, 7.0]]])      # page 0 and 6, 7 forced (8 filled)
    got = choose_pages(bounds, torch.tensor([8]), torch.tensor([4]), rule)
    assert got.tolist() == [[[0, 3, 6, 7]]]
    tie = torch.tensor([[[0.0, 4.0, 4.0, 4.0, 0.0, 0.0]]])                      # ties go to the lower page
    assert choose_pages(tie, torch.tensor([6]), torch.tensor([4]), rule).tolist() == [[[0, 1, 4, 5]]]
    short = choose_pages(bounds, torch.tensor([3]), torch.tensor([3]), rule)   # fewer pages than the count
    assert short.tolist() == [[[0, 1, 2]]]


# --- against the reference ---

@pytest.mark.parametrize("name", list(RULES))
@pytest.mark.parametrize("kind", KINDS)
def test_matches_the_reference(kind, name, monkeypatch):
    pages = check_against_reference(kind, RULES[name], monkeypatch)
    steps = pages[RULES[name].dense_layers]
    read = {len(col) for step in steps for row in step for col in row}
    assert max(read) < max(len(set(sum(col, []))) for col in [[c for row in step for c in row] for step in steps])
    # some column skips a page between its sink and recent ones: the selection is not a window
    assert any(col != list(range(col[0], col[0] + len(col))) for step in steps for row in step for col in row)


@pytest.mark.parametrize("name", ["pages-4", "keys"])
def test_torch_ops_match_the_reference(name, monkeypatch):
    """Without the compiled build (a GPU's path): the gathered pages upcast and attended, and the int4 key copy
    scored, by the torch ops."""
    monkeypatch.setenv(build.OFF_SWITCH, "0")
    check_against_reference("llama-gqa", RULES[name], monkeypatch)


def test_the_compiled_key_mass_is_the_torch_ops():
    """The compressed-cache kernel without values (kernels.Kernels.key_mass) against the torch ops' mass, within
    two fp32 orders of a softmax over 64-term dot products (tolerances.attention_bounds' terms, at 1e-5 here:
    probabilities are at most 1)."""
    from flexgen_h2o.kernels import resolve
    from flexgen_h2o.kv.pages import SKETCH
    from flexgen_h2o.models.ops import TORCH
    kernels = resolve()
    if not hasattr(getattr(kernels, "ext", None), "decode_attention_quant"):
        pytest.skip("no compiled kernels here")
    gen = torch.Generator().manual_seed(0)
    b, g, r, s, d = 3, 2, 3, 70, 64
    rows = SKETCH.pack(torch.randn(b, g, s, d, generator=gen))
    q = torch.randn(b, g * r, 1, d, generator=gen)
    slot = torch.tensor([[40, 40], [69, 69], [5, 5]])
    valid = torch.arange(s).view(1, 1, s) <= slot[:, :, None]
    zero = torch.zeros(b, g, 1, d)
    got = kernels.key_mass(q, rows, valid, slot, zero, 0.125, SKETCH)
    want = TORCH.key_mass(q, rows, valid, slot, zero, 0.125, SKETCH)
    assert got.shape == (b, g, s) and torch.allclose(got, want, atol=1e-5, rtol=0)
    assert bool((got[~valid] == 0).all()) and torch.allclose(got.sum(-1), torch.full((b, g), float(r)), atol=1e-5)


@pytest.mark.parametrize("placement", ["host", "disk", "mixed"])
def test_every_tier_matches_the_reference(placement, monkeypatch, tmp_path):
    check_against_reference("llama-gqa", RULES["pages-4"], monkeypatch, offload=fp32(**PLACEMENTS[placement]),
                            offload_dir=tmp_path)


@pytest.mark.parametrize("placement", ["disk", "mixed"])
def test_reading_ahead_on_the_kv_lanes_thread_matches_the_reference(placement, monkeypatch, tmp_path):
    """With KV on disk the KV lane has its own thread: the read ahead runs there, after the cache's commit."""
    check_against_reference("opt", RULES["ahead"], monkeypatch, offload=fp32(**PLACEMENTS[placement]),
                            offload_dir=tmp_path)


def test_a_budget_of_every_page_is_the_full_cache(tmp_path):
    """Bit for bit, on the compute tier and with the KV on disk, fp32, fp16 and int4 KV."""
    model = tiny_hf("llama-gqa")
    prompts = random_prompts(LENGTHS)

    def run(ev, **offload):
        engine = make_engine(model, eviction=ev, offload=OffloadPolicy(gpu_batch_size=3, **offload),
                             offload_dir=tmp_path)
        try:
            out = engine.generate(prompts, greedy(N_NEW))
            return out.token_ids, [engine.step_logits[i] for i in range(len(prompts))]
        finally:
            engine.close()

    every = EvictionConfig(pages=PageRule(page_size=4, fetch_ratio=1.0))
    for offload in (dict(kv_dtype="float32"), dict(kv_dtype="float16", **PLACEMENTS["disk"]), dict(kv_bits=4)):
        full_tokens, full_logits = run(EvictionConfig(), **offload)
        tokens, logits = run(every, **offload)
        assert tokens == full_tokens
        assert all(torch.equal(a, b) for x, y in zip(logits, full_logits) for a, b in zip(x, y))


def test_a_compressed_cache_selects(monkeypatch):
    """int4 KV with a 4-page read: every cache is compressed and logs its choices, and the logits differ from the
    compressed full cache's (the selection acts; every page read is the full cache bit for bit, above)."""
    monkeypatch.setattr(PagedKVCache, "record_pages", True)
    model = tiny_hf("llama-gqa")
    prompts = random_prompts(LENGTHS)
    runs = {}
    for name, ev in (("full", EvictionConfig()), ("pages", EvictionConfig(pages=RULES["keys"]))):
        engine = make_engine(model, eviction=ev, offload=OffloadPolicy(kv_bits=4, gpu_batch_size=3))
        try:
            out = engine.generate(prompts, greedy(N_NEW))
            runs[name] = (out.token_ids, [engine.step_logits[i] for i in range(len(prompts))])
            if name == "pages":
                assert all(c.fmt.quantized and c.page_log for c in all_caches(engine))
        finally:
            engine.close()
    assert any(not torch.equal(a, b) for x, y in zip(runs["full"][1], runs["pages"][1]) for a, b in zip(x, y))


@pytest.mark.parametrize("name", ["pages-4", "ahead"])
def test_alone_equals_in_a_batch(name):
    assert_alone_equals_batch(tiny_hf("llama-gqa"), random_prompts(LENGTHS), EvictionConfig(pages=RULES[name]),
                              N_NEW)


# --- what a step reads ---

def test_the_counters_count_the_pages_read():
    """K and V bytes of the pages read, summaries apart, against the rule's count."""
    model = tiny_hf("llama-gqa")
    rule = RULES["pages-4"]
    engine = make_engine(model, eviction=EvictionConfig(pages=rule), offload=fp32())
    try:
        engine.generate([random_prompts([24])[0]], greedy(N_NEW))
        cache = all_caches(engine)[0]
        g, d = 2, 16
        steps = range(24, 24 + N_NEW - 1)                  # tokens held before each decode step's own
        want = sum(rule.pages_read(n + 1) for n in steps) * g * rule.page_size * 2 * d * 4
        assert cache.bytes_read["compute"] == want
        assert cache.bytes_read["summaries"] > 0
    finally:
        engine.close()


def _os_counts_reads(folder) -> bool:
    """Whether this process's storage reads show in /proc/self/io here (not on tmpfs, nor where the kernel does not
    account them): a cold 64 KiB file read once."""
    from flexgen_h2o.memory.tier import drop_file_cache
    if proc_read_bytes() < 0:
        return False
    path = folder / "probe.bin"
    path.write_bytes(os.urandom(1 << 16))
    drop_file_cache(path)
    before = proc_read_bytes()
    path.read_bytes()
    return proc_read_bytes() - before >= 1 << 16


def test_the_disk_tier_reads_only_the_chosen_pages(tmp_path):
    """A cold cache file on disk (dropped from the page cache), one step's selection: the OS reads the pages the
    engine counts, not the file. 64-wide fp16 rows, 32-token pages: one page of one head is one 4 KiB OS page."""
    from flexgen_h2o.kv import get_policy
    from flexgen_h2o.memory.tier import DiskTier, drop_from_memory
    from flexgen_h2o.models.layer import KVSpec
    if not _os_counts_reads(tmp_path):
        pytest.skip("this file system or kernel does not count the process's storage reads in /proc/self/io")

    tier = DiskTier(tmp_path)
    handles = []

    def alloc(shape, dtype):
        handles.append(tier.allocate(shape, dtype))
        return tier.torch_view(handles[-1], random=True)

    b, g, d, n = 4, 2, 64, 2048
    rule = PageRule(page_size=32, fetch_ratio=0.2)
    ev = EvictionConfig()
    cache = PagedKVCache(KVSpec(g, d), b, n + 32, get_policy("full"), ev.resolve(n, 8), pages=rule, alloc=alloc,
                         tier_kind="disk")
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(b, g, n, d, generator=gen) for _ in range(2))
    cache.commit_prefill(k, v, None, torch.arange(n).expand(b, n), unpadded=True)
    try:
        q = torch.randn(b, 2 * g, 1, d, generator=gen)
        cache.stage(torch.device("cpu"), torch.float32).select(q)     # first calls load what they load
        for tensor, h in zip((cache.k, cache.v, cache.score, cache.pos), handles):
            drop_from_memory(tensor, h.payload.path)
        cache.bytes_read.clear()
        before = proc_read_bytes()
        view = cache.stage(torch.device("cpu"), torch.float32)
        view.select(q)
        read = proc_read_bytes() - before
        counted = cache.bytes_read["disk"]
        whole = 2 * b * g * (n + 32) * d * 2
        assert counted == b * g * rule.pages_read(n + 1) * 32 * 2 * d * 2
        assert read == counted, (read, counted, whole)
        assert read < 0.3 * whole
    finally:
        tier.close()


# --- flags ---

@pytest.mark.parametrize("flags,says", [
    (["--kv-select", "pages"], "--fetch-ratio"),
    (["--kv-select", "pages", "--fetch-ratio", "0.2", "--fetch-pages", "3"], "one of them"),
    (["--kv-select", "pages", "--fetch-ratio", "0.2", "--hh-ratio", "0.1"], "keeps every token"),
    (["--fetch-ratio", "0.2"], "--kv-select pages"),
    (["--page-size", "16"], "--kv-select pages"),
    (["--page-score", "bound"], "--kv-select pages"),
    (["--kv-select", "pages", "--fetch-ratio", "0.2", "--position-rolling"], "keeps every token"),
    (["--page-ahead"], "--kv-select pages"),
    (["--kv-select", "pages", "--fetch-ratio", "0.2", "--page-ahead", "--overlap", "false"], "overlapped schedule"),
])
def test_refusals(flags, says, capsys, tmp_path, monkeypatch):
    assert says in cli_error(flags, capsys, tmp_path, monkeypatch)


def test_the_hf_cache_reads_the_engines_pages(monkeypatch):
    """H2OCache with page selection in transformers' generate: the engine's tokens (two fp32 orders), every
    token kept."""
    from flexgen_h2o.hf import H2OCache, enable_h2o
    model = enable_h2o(tiny_hf("llama-gqa"))
    prompts = random_prompts(LENGTHS)
    ids, mask = left_padded(model, prompts)
    rule = RULES["pages-4"]
    cache = H2OCache(EvictionConfig(pages=rule), max_new_tokens=N_NEW)
    with torch.no_grad():
        res = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=N_NEW, min_new_tokens=N_NEW,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=model.config.pad_token_id, eos_token_id=None)
    tokens, logits = res.sequences[:, ids.shape[1]:], [l.float() for l in res.logits]
    want = dict(page_size=rule.page_size, fetch_ratio=None, fetch_pages=rule.fetch_pages,
                sink_pages=rule.sink_pages, recent_pages=rule.recent_pages)
    ref_tokens, ref_logits, _ = page_reference_generate(model, ids, mask, want, N_NEW)
    assert same_run(model, tokens.tolist(), ref_tokens.tolist(), logits, ref_logits) == [N_NEW] * len(prompts)
    assert [len(col) for col in cache.kept_positions()[0][0]] == [len(prompts[0]) + N_NEW - 1] * 2


def test_the_hf_cache_refuses_reading_ahead():
    from flexgen_h2o.hf import H2OCache
    with pytest.raises(ValueError, match="a layer ahead"):
        H2OCache(EvictionConfig(pages=RULES["ahead"]), max_new_tokens=N_NEW)


def test_the_startup_line_says_what_a_step_reads():
    line = PageRule(fetch_ratio=0.2).describe(2048, 512, 1000.0)
    assert line.startswith("KV read per step: pages of 32 tokens, 20% of each sequence")
    assert "= 0.4-0.5 MB of 2.0-2.6 MB; nothing is evicted" in line        # 13 pages of 2049 tokens, 16 of 2560


def test_a_batch_job_records_what_a_step_reads():
    """Resuming a batch job under other page flags is refused as any changed setting is; a job without page
    selection records nothing new (older records still match)."""
    from flexgen_h2o.frontends.cli import build_parser
    from flexgen_h2o.frontends.settings import answer_settings
    parse = build_parser().parse_args
    base = ["--model", "opt-125m"]
    assert "kv_select" not in answer_settings(parse(base), 8)
    pages = answer_settings(parse(base + ["--kv-select", "pages", "--fetch-ratio", "0.2"]), 8)
    assert (pages["kv_select"], pages["page_size"], pages["fetch_ratio"]) == ("pages", 32, 0.2)
    assert answer_settings(parse(base + ["--kv-select", "pages", "--fetch-ratio", "0.2", "--page-size", "32"]),
                           8) == pages
    ahead = answer_settings(parse(base + ["--kv-select", "pages", "--fetch-ratio", "0.2", "--page-ahead"]), 8)
    assert ahead == {**pages, "page_ahead": True}
    assert answer_settings(parse(base + ["--kv-select", "pages", "--fetch-pages", "4"]), 8) != pages
