"""kvpress's presses as rows of the accuracy grid (eval/peers.py, benchmarks/systems/kvpress_eval*.py): the ratio
that keeps exactly `keep` tokens, --policies parsing, the budgets and records of a row through a stand-in bridge,
the one-line refusals, and (slow, with the kvpress virtualenv) the child on SmolLM2 and a row end to end."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import time
from pathlib import Path

import pytest

from flexgen_h2o.config import ConfigError, GenerationConfig
from flexgen_h2o.eval import peers
from flexgen_h2o.eval.cli import main
from flexgen_h2o.eval.grid import GridPoint, make_grid, parse_budget, parse_policies

ROOT = Path(__file__).resolve().parents[2]
CHILD = ROOT / "benchmarks" / "systems" / "kvpress_eval_child.py"


def load_child():
    spec = importlib.util.spec_from_file_location("kvpress_eval_child_under_test", CHILD)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def kvpress_python() -> Path:
    from benchmarks.systems import kvpress_eval
    if kvpress_eval.venv_reason():
        pytest.skip(f"no kvpress virtualenv: {kvpress_eval.venv_reason()}")
    return kvpress_eval.venv_python()


def test_the_ratio_keeps_exactly_keep_tokens():
    child = load_child()
    nudged = 0
    lengths = list(range(1, 400)) + list(range(400, 9000, 37)) + [1024, 2048, 4096, 8192]
    for n in lengths:
        keeps = range(1, n + 1) if n < 400 else sorted({1, 2, n // 5, n // 3, n // 2, n - 1, n, *range(1, n, 97)})
        for keep in keeps:
            r = child.ratio_for(keep, n)
            assert 0 <= r < 1 and int(n * (1 - r)) == keep and child.n_kept(n, r) == keep
            nudged += r != 1 - keep / n
    assert nudged > 0                   # 1 - keep / n alone truncates one short for many pairs (e.g. 40 of 200)
    assert child.ratio_for(40, 200) != 0.8 and child.ratio_for(7, 7) == 0.0
    with pytest.raises(child.InputError):
        child.ratio_for(0, 10)


def test_policies_accept_the_kvpress_rows_at_the_grid_budget():
    assert parse_policies("full,snapkv,kvpress-snapkv,kvpress-adakv") == ["full", "snapkv", "kvpress-snapkv",
                                                                       "kvpress-adakv"]
    with pytest.raises(ConfigError, match="kvpress-tova"):         # the choices name the rows
        parse_policies("kvpress-h2o")
    points = make_grid(["full", "kvpress-tova"], [parse_budget("20%"), parse_budget("3")], heavy_share=0.5)
    assert [p.key for p in points] == ["full", "kvpress-tova@20%", "kvpress-tova@3"]
    assert points[1].heavy_share is None
    assert points[1].slots(2058) == GridPoint("h2o", parse_budget("20%")).slots(2058) == 412
    assert points[2].slots(100) == 3                 # no sink minimum: a press has no sinks to make room for
    with pytest.raises(ConfigError, match="kvpress row"):
        points[1].eviction(100)


class FakeBridge:
    """run_items as the child answers: each item's keep recorded, tokens 5, 6, 10 (a newline), 2 (EOS), 7."""

    def __init__(self):
        self.calls = []

    def venv_reason(self):
        return None

    def run_items(self, store, press, items, eos_id, on_item):
        self.calls.append((press, items, eos_id))
        meta = {"kvpress_version": "0.5.5", "press_class": "SnapKVPress", "params": {"window_size": 64}}
        for i, it in enumerate(items):
            base = {"index": i, "evicted": it["keep"] < len(it["prompt"]), "prefill_s": 1.0, "decode_s": 0.5}
            if it["forced"] is None:
                on_item({**base, "generated": [5, 6, 10, 2, 7][:it["max_new"]]}, meta)
            else:
                on_item({**base, "nll": [0.5] * len(it["forced"]), "hit": [True] * len(it["forced"])}, meta)
        return meta


class Saved:
    def __init__(self, blocks=None):
        self.blocks = dict(blocks or {})

    def get(self, key, block):
        return self.blocks.get((key, block))

    def put(self, key, block, value):
        self.blocks[(key, block)] = value


def test_a_row_keeps_the_blocks_slots_and_cuts_as_the_engine(monkeypatch):
    fake = FakeBridge()
    monkeypatch.setattr(peers, "bridge", lambda: fake)
    prompts = [[1] * 100, [1] * 120, [1] * 50]
    blocks = [range(0, 2), range(2, 3)]
    decode = lambda ids: "".join("\n" if t == 10 else chr(97 + t % 26) for t in ids)     # noqa: E731
    point = GridPoint("kvpress-snapkv", parse_budget("20%"))
    ckpt = Saved()
    gen = GenerationConfig(max_new_tokens=10, stop=("\n",), stop_at_eos=True)
    out = peers.peer_grid(point, prompts, blocks, store=Path("s"), eos_id=2, decode=decode, gen=gen, checkpoint=ckpt)
    press, items, eos = fake.calls[0]
    assert press == "snapkv" and eos == 2
    # the block's longest sequence (120 + 10) sets the slots of both its prompts; the last block its own (50 + 10)
    assert [it["keep"] for it in items] == [26, 26, 12] and [it["max_new"] for it in items] == [10] * 3
    assert [b["slots"] for b in out] == [26, 12] and out[0]["evicted"] and out[0]["seconds"] == 3.0
    assert out[0]["result"] == {"tokens": [[5, 6, 10], [5, 6, 10]], "texts": ["fg", "fg"]}    # the stop string
    assert out[1]["peer"]["system"] == "kvpress" and out[1]["peer"]["press_class"] == "SnapKVPress"
    assert set(ckpt.blocks) == {(point.key, 0), (point.key, 1)}
    # no stop string: EOS ends it (and is dropped from the text); a slot budget above a prompt keeps it whole
    big = GridPoint("kvpress-snapkv", parse_budget("64"))
    out = peers.peer_grid(big, prompts, blocks, store=Path("s"), eos_id=2, decode=decode,
                          gen=GenerationConfig(max_new_tokens=10), checkpoint=Saved({(big.key, 0): {"result": "x"}}))
    assert [it["keep"] for it in fake.calls[-1][1]] == [50]          # block 0 came from the checkpoint
    assert out[0] == {"result": "x"} and out[1]["result"]["tokens"] == [[5, 6, 10, 2]]
    assert out[1]["evicted"] is False
    # teacher forcing: one row per item with its NLLs
    out = peers.peer_grid(point, prompts, blocks, store=Path("s"), eos_id=2, decode=decode,
                          continuations=[[3, 4], [3], [9, 9, 9]])
    assert [it["keep"] for it in fake.calls[-1][1]] == [24, 24, 11] and fake.calls[-1][1][0]["forced"] == [3, 4]
    assert out[1]["result"] == [{"nll": [0.5] * 3, "hit": [True] * 3}]
    with pytest.raises(ConfigError, match="greedily"):
        peers.peer_grid(point, prompts, blocks, store=Path("s"), eos_id=2, decode=decode,
                        gen=GenerationConfig(temperature=0.7))


def run_cli(args, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(args))
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("task,extra", [("perplexity", []), ("needle", []),
                                        ("streaming", ["--stream-policies", "full,kvpress-snapkv"])])
def test_tasks_without_equal_cache_refuse_the_rows(task, extra, capsys, tmp_path):
    code, err = run_cli(["--tasks", task, "--policies", "full,kvpress-snapkv", "--out", str(tmp_path)] + extra, capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: kvpress-snapkv cannot run the " + task)
    assert "prefill only" in err and "equal cache" in err


def test_a_missing_virtualenv_or_bridge_is_one_error_line(monkeypatch, capsys, tmp_path):
    from benchmarks.systems import kvpress_eval
    monkeypatch.setattr(kvpress_eval, "venv_dir", lambda: tmp_path / "none")
    monkeypatch.setattr(kvpress_eval, "venv_python", lambda: tmp_path / "none" / "bin" / "python")
    args = ["--tasks", "haystack", "--policies", "full,kvpress-tova", "--out", str(tmp_path)]
    code, err = run_cli(args, capsys)
    assert code == 2 and err.count("\n") == 1 and "virtualenv" in err and "ensure_venv" in err
    monkeypatch.setattr(peers, "BRIDGE", "no_such_package_here.kvpress_eval")
    code, err = run_cli(args, capsys)
    assert code == 2 and err.count("\n") == 1 and "benchmarks package" in err


@pytest.mark.slow
def test_the_child_on_smollm2_generates_and_scores(tmp_path):
    """Two items of ~100 tokens under SnapKV at keep 30: the cache after prefill holds 30 tokens per KV head,
    then grows by one per step; the forced item's NLLs are finite and its flags booleans."""
    from flexgen_h2o.weights import default_store_path
    py, store = kvpress_python(), default_store_path("smollm2-135m")
    if not (store / "manifest.json").is_file():
        pytest.skip("needs the smollm2-135m store (make run)")
    prompt = [(i * 7919) % 20000 + 100 for i in range(100)]
    spec = {"store": str(store), "press": "snapkv", "eos_id": 2,
            "items": [{"prompt": prompt, "forced": None, "max_new": 5, "keep": 30},
                      {"prompt": prompt[:90], "forced": prompt[90:96], "max_new": 6, "keep": 30}]}
    (tmp_path / "in.json").write_text(json.dumps(spec))
    t0 = time.perf_counter()
    proc = subprocess.run([str(py), str(CHILD), "--input", str(tmp_path / "in.json"), "--json",
                           str(tmp_path / "out.json")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads((tmp_path / "out.json").read_text())
    gen, forced = out["items"]
    assert out["press_class"] == "SnapKVPress" and out["params"] == {"window_size": 64, "kernel_size": 5}
    assert out["compression"].startswith("prefill-only") and out["attn_implementation"] == "sdpa"
    assert 1 <= len(gen["generated"]) <= 5 and gen["keep"] == 30 and gen["evicted"]
    assert gen["kv_tokens_end"] == 30 + len(gen["generated"]) - 1
    assert len(forced["nll"]) == len(forced["hit"]) == 6 and forced["kv_tokens_end"] == 30 + 5
    assert all(0 <= x < 50 for x in forced["nll"]) and all(isinstance(h, bool) for h in forced["hit"])
    assert int(90 * (1 - forced["compression_ratio"])) == 30
    assert [ln.split(" ")[0] for ln in proc.stdout.splitlines()] == ["meta", "item", "item"]
    assert time.perf_counter() - t0 < 600


@pytest.mark.slow
def test_a_kvpress_row_end_to_end_on_a_tiny_model(tiny_folder, tmp_path, capsys):
    """haystack with kvpress-snapkv beside full on the tiny Llama: at 100 % nothing is compressed and the NLLs
    are full's (fp32 both sides); at 20 % the row keeps the slots h2o gets; resumed, nothing runs again."""
    kvpress_python()
    out = tmp_path / "eval"
    args = ["--model", str(tiny_folder), "--path", str(tmp_path / "store"), "--out", str(out), "--tasks", "haystack",
            "--policies", "full,h2o,kvpress-snapkv", "--budgets", "20%,100%", "--batch-size", "4", "--no-progress",
            "--haystack-len", "400", "--haystack-depths", "0,100", "--kv-dtype", "float32"]
    assert main(args) == 0
    hay = json.loads((out / "haystack.json").read_text())["records"]
    same, full = hay["kvpress-snapkv@100%"], hay["full"]
    assert same["blocks_evicting"] == 0 and same["answer_nll"] == pytest.approx(full["answer_nll"], rel=1e-5)
    assert hay["kvpress-snapkv@20%"]["blocks_evicting"] == 1
    assert hay["kvpress-snapkv@20%"]["slots_max"] == hay["h2o@20%"]["slots_max"]
    assert hay["kvpress-snapkv@20%"]["peer"]["press_class"] == "SnapKVPress"
    assert "| kvpress-snapkv |" in (out / "report.md").read_text()
    capsys.readouterr()
    assert main(args) == 0 and "resuming" in capsys.readouterr().out
