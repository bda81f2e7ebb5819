"""The Python API: `LLM(...).generate(...)` on the tiny checkpoint (tests/conftest.py's `tiny`), its checks, and the
same tokens as the CLI."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flexgen_h2o import LLM, Completion, ConfigError, EvictionConfig, OffloadPolicy, PreflightError
from flexgen_h2o.planner import Machine
from tests.tiny_checkpoint import REPO, run_main

PROMPTS = ["Hello there", "a", "The quick brown fox jumps", "xyz", "Lorem ipsum dolor sit amet, consectetur",
           "12345", "What is this?"]


@pytest.fixture(scope="module", autouse=True)
def home(tiny):
    """The API finds its stores under $FLEXGEN_H2O_HOME: the tiny checkpoint's, converted there already."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLEXGEN_H2O_HOME", tiny[1]["FLEXGEN_H2O_HOME"])
        yield


@pytest.fixture(scope="module")
def llm(tiny, home):
    with LLM(str(tiny[0]), offload={"gpu_batch_size": 3}) as model:
        yield model


def test_generate_in_order_with_counts(llm):
    outs = llm.generate(PROMPTS, max_new_tokens=6)
    assert [type(o) for o in outs] == [Completion] * len(PROMPTS)
    assert [o.index for o in outs] == list(range(len(PROMPTS))) and [o.prompt for o in outs] == PROMPTS
    tok = llm.tokenizer
    for o in outs:
        assert o.prompt_token_ids == tok.encode(o.prompt) and len(o.prompt_token_ids) == len(o.prompt)
        assert o.finish_reason in ("length", "eos")
        if o.finish_reason == "length":
            assert len(o.token_ids) == 6 and o.text == tok.decode(o.token_ids, skip_special_tokens=True)
        assert str(o) == o.text
    # continuous refill by default: one block of 3 rows, 7 prompts joining as rows free up
    assert llm.last_metrics["blocks"] == 1 and llm.last_metrics["joins"] >= 2
    assert llm.last_metrics["prompt_tokens"] == sum(map(len, PROMPTS))
    # one prompt per block (no padding, no bucketing) gives the same tokens: results map to the right prompt
    with LLM(llm.config.name, offload={"gpu_batch_size": 1}, refill=False) as single:      # the checkpoint folder
        alone = single.generate(PROMPTS, max_new_tokens=6)
        assert single.last_metrics["blocks"] == len(PROMPTS) and "joins" not in single.last_metrics
    assert [o.token_ids for o in alone] == [o.token_ids for o in outs]


def test_per_prompt_budgets_stop_strings_and_token_ids(llm):
    budgets = [1, 2, 3, 4, 5, 6, 7]
    outs = llm.generate(PROMPTS, max_new_tokens=budgets, stop_at_eos=False)
    assert [len(o.token_ids) for o in outs] == budgets
    assert all(o.finish_reason == "length" for o in outs)
    long = llm.generate(PROMPTS[4], max_new_tokens=12, stop_at_eos=False)[0]
    stop = long.text[3:5]
    cut = llm.generate([PROMPTS[4]], max_new_tokens=12, stop=stop, stop_at_eos=False)[0]
    assert cut.finish_reason == "stop" and cut.text == long.text[:long.text.find(stop)]
    assert long.token_ids[:len(cut.token_ids)] == cut.token_ids
    by_ids = llm.generate([llm.tokenizer.encode(PROMPTS[4])], max_new_tokens=12, stop_at_eos=False)[0]
    assert by_ids.token_ids == long.token_ids and by_ids.prompt is None


def test_sampling_is_seeded(llm):
    a = llm.generate(PROMPTS, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=5, stop_at_eos=False)
    b = llm.generate(PROMPTS, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=5, stop_at_eos=False)
    c = llm.generate(PROMPTS, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=6, stop_at_eos=False)
    assert [o.token_ids for o in a] == [o.token_ids for o in b] != [o.token_ids for o in c]


def test_bad_calls_raise_clear_errors(llm):
    with pytest.raises(ConfigError, match="no chat template"):
        llm.chat(["hi"])
    with pytest.raises(ConfigError, match="all be strings, or all be lists of token ids"):
        llm.generate(["hi", [5, 6]])
    with pytest.raises(ConfigError, match="max_new_tokens has 1 entries for 2 prompts"):
        llm.generate(["hi", "ho"], max_new_tokens=[3])
    with pytest.raises(ConfigError, match=r"prompt 1: prompt \(600 tokens\) \+ max_new_tokens \(4\) exceed"):
        llm.generate(["ok", "x" * 600], max_new_tokens=4)
    with pytest.raises(TypeError, match="unexpected argument"):
        llm.chat(["hi"], max_tokens=3)


def test_policies_by_name_and_dict(tiny):
    with LLM(str(tiny[0]), offload={"percent": [0, 100, 50, 50, 100, 0], "gpu_batch_size": 2},
             eviction={"hh_ratio": 0.25}) as model:
        assert model.offload.percent == (0, 100, 50, 50, 100, 0) and model.eviction.policy == "h2o"
        assert "hh_ratio=0.25" in repr(model)
        outs = model.generate([PROMPTS[i] for i in (0, 2, 4, 6)], max_new_tokens=3, stop_at_eos=False)
        assert [len(o.token_ids) for o in outs] == [3] * 4
        # a budget is each prompt's own: 25 % of "a"'s 1 token is 0 heavy hitters, refused up front
        with pytest.raises(ConfigError, match=r"prompt 1: the eviction budget is 0 slots for prompt_len 1"):
            model.generate(PROMPTS[:4], max_new_tokens=3)
    with pytest.raises(ConfigError, match="offload must be an OffloadPolicy"):
        LLM(str(tiny[0]), offload=[100, 0])


def test_preflight_refuses_before_loading_and_before_generating(tiny, monkeypatch):
    with pytest.raises(PreflightError, match=r"opt-175b does not fit this machine \(RAM\)"):
        LLM("opt-175b", dummy_weights=True, offload=OffloadPolicy.from_percent([0, 100, 100, 0, 100, 0]))
    with LLM(str(tiny[0])) as model:
        monkeypatch.setattr(Machine, "probe", classmethod(lambda cls, backend=None: cls(1 << 20, 1 << 30)))
        with pytest.raises(PreflightError, match="RAM: need"):
            model.generate(PROMPTS, max_new_tokens=4)


def test_import_is_light():
    code = "import sys, flexgen_h2o; assert 'torch' not in sys.modules; print(sorted(flexgen_h2o.__all__))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "'LLM'" in out.stdout and "'EvictionConfig'" in out.stdout and "'OffloadPolicy'" in out.stdout


def test_api_gives_the_cli_tokens(tiny, tmp_path):
    """Same prompts, seed, sampling and policies: the CLI's batch output equals LLM.generate, id by id."""
    ckpt, env = tiny
    # 8 prompts: every GPU batch holds 2 sequences, one with its KV on the compute tier and one in host memory
    prompts, budgets = PROMPTS + ["one more prompt"], [6, 9, 4, 9, 7, 9, 5, 8]
    rows = [{"prompt": p, "id": f"p{i}", "max_new_tokens": n} for i, (p, n) in enumerate(zip(prompts, budgets))]
    offload = OffloadPolicy.from_percent([0, 100, 50, 50, 100, 0], gpu_batch_size=2, num_gpu_batches=2)
    sampling = dict(temperature=0.9, top_k=20, seed=7)
    # a sink keeps the 1- and 3-token prompts' own budgets (30 % of them is 0 slots) above zero
    ev = EvictionConfig(policy="h2o", hh_ratio=0.3, sink_size=1)
    with LLM(str(ckpt), offload=offload, eviction=ev) as model:
        first = model.generate(prompts, max_new_tokens=budgets, **sampling)
        stop = next(o.text[2:4] for o in first if len(o.text) >= 6)
        api = model.generate(prompts, max_new_tokens=budgets, stop=stop, **sampling)
    assert "stop" in [o.finish_reason for o in api]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = run_main(["--model", str(ckpt), "--input", str(inp), "--output", str(out), "--percent", "0", "100", "50",
                     "50", "100", "0", "--gpu-batch-size", "2", "--num-gpu-batches", "2", "--hh-ratio", "0.3",
                     "--sink-size", "1", "--temperature", "0.9", "--top-k", "20", "--seed", "7", "--stop", stop,
                     "--no-progress"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cli = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in cli] == [r["id"] for r in rows]
    assert [r["token_ids"] for r in cli] == [o.token_ids for o in api]
    assert [r["text"] for r in cli] == [o.text for o in api]
    assert [r["finish_reason"] for r in cli] == [o.finish_reason for o in api]
