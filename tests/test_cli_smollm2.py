"""The CLI and the API on real SmolLM2-135M-Instruct weights (slow): benchmark mode, and batch mode with the
chat template giving the same tokens as `LLM.chat`."""
from __future__ import annotations

import json
import re

import pytest

from flexgen_h2o import LLM, EvictionConfig, OffloadPolicy
from flexgen_h2o.weights import store_root
from tests.tiny_checkpoint import cli_env, run_cli

pytestmark = pytest.mark.slow
QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "Say hello in Spanish."]


def test_benchmark_on_real_weights(tmp_path):
    mj, log = tmp_path / "m.json", tmp_path / "log"
    proc = run_cli(["--model", "smollm2-135m", "--prompt-len", "64", "--gen-len", "8", "--hh-ratio", "0.2",
                    "--gpu-batch-size", "2", "--metrics-json", str(mj), "--log-file", str(log)], cli_env(store_root()),
                   timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "prompts: 2 x 64 tokens of Lee news corpus, tokenized" in proc.stdout
    assert "sample continuation of prompt 0: '" in proc.stdout
    assert "KV cache: h2o, 24 slots/seq (12 heavy + 12 recent) = 33.3% of 64+8" in proc.stdout
    m = json.loads(mj.read_text())
    assert (m["model"], m["block_size"], m["generated_tokens"], m["projected"]) == ("smollm2-135m", 2, 16, False)
    assert m["kv_cache_bytes"] * 72 == m["full_cache_bytes"] * 25
    lines = log.read_text().splitlines()
    assert len(lines) == 5 and lines[1].endswith("projected: False")
    assert float(re.search(r"total throughput: ([\d.]+)", lines[4]).group(1)) == pytest.approx(m["total_tok_s"],
                                                                                               abs=1e-3)


def test_batch_chat_matches_api(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"prompt": q, "id": f"q{i}"}) + "\n" for i, q in enumerate(QUESTIONS)))
    proc = run_cli(["--model", "smollm2-135m", "--input", str(inp), "--output", str(out), "--gen-len", "12",
                    "--hh-ratio", "0.3", "--gpu-batch-size", "2", "--no-progress"], cli_env(store_root()), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cli = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in cli] == ["q0", "q1", "q2"]
    assert "Paris" in cli[0]["text"]
    with LLM("smollm2-135m", offload=OffloadPolicy(gpu_batch_size=2),
             eviction=EvictionConfig(policy="h2o", hh_ratio=0.3)) as llm:
        api = llm.chat(QUESTIONS, max_new_tokens=12)
    assert [r["token_ids"] for r in cli] == [o.token_ids for o in api]
    assert [r["text"] for r in cli] == [o.text for o in api]
    assert all(r["prompt_tokens"] == len(o.prompt_token_ids) > len(q.split()) for r, o, q in zip(cli, api, QUESTIONS))
