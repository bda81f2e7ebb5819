"""The CLI (run.main in this process, tests/tiny_checkpoint.py's run_main) and the API on real SmolLM2-135M-Instruct
weights (slow): benchmark mode, and batch mode, where a `messages` line gives the same tokens as `LLM.chat` and a
`prompt` line, raw text, those of `LLM.generate`."""
from __future__ import annotations

import json
import re

import pytest

from flexgen_h2o import LLM, EvictionConfig, OffloadPolicy
from flexgen_h2o.weights import store_root
from tests.tiny_checkpoint import cli_env, run_main

pytestmark = pytest.mark.slow
QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "Say hello in Spanish."]


def test_benchmark_on_real_weights(tmp_path):
    mj, log = tmp_path / "m.json", tmp_path / "log"
    proc = run_main(["--model", "smollm2-135m", "--prompt-len", "64", "--gen-len", "8", "--hh-ratio", "0.2",
                     "--gpu-batch-size", "2", "--metrics-json", str(mj), "--log-file", str(log)], cli_env(store_root()))
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


def test_batch_messages_match_chat_and_prompts_match_generate(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"messages": [{"role": "user", "content": q}], "id": f"q{i}"} for i, q in enumerate(QUESTIONS)]
    rows += [{"prompt": q, "id": f"raw{i}"} for i, q in enumerate(QUESTIONS)]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = run_main(["--model", "smollm2-135m", "--input", str(inp), "--output", str(out), "--gen-len", "12",
                     "--hh-ratio", "0.3", "--gpu-batch-size", "2", "--no-progress"], cli_env(store_root()))
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in recs] == ["q0", "q1", "q2", "raw0", "raw1", "raw2"]
    chats, raws = recs[:3], recs[3:]
    assert "Paris" in chats[0]["text"]
    with LLM("smollm2-135m", offload=OffloadPolicy(gpu_batch_size=2),
             eviction=EvictionConfig(policy="h2o", hh_ratio=0.3)) as llm:
        api = llm.chat(QUESTIONS, max_new_tokens=12)
        plain = llm.generate(QUESTIONS, max_new_tokens=12)
        encoded = [llm.tokenizer.encode(q) for q in QUESTIONS]
    assert [r["token_ids"] for r in chats] == [o.token_ids for o in api]
    assert [r["text"] for r in chats] == [o.text for o in api]
    assert all(r["prompt_tokens"] == len(o.prompt_token_ids) > len(q.split()) for r, o, q in zip(chats, api, QUESTIONS))
    # a "prompt" line is the text as it is: the tokenizer's plain encode, no chat template around it
    assert [r["prompt_tokens"] for r in raws] == [len(e) for e in encoded] == [len(o.prompt_token_ids) for o in plain]
    assert all(len(e) < r["prompt_tokens"] for e, r in zip(encoded, chats))
    assert [r["token_ids"] for r in raws] == [o.token_ids for o in plain]
