"""Batch input forms end to end, through run.main in this process (tests/tiny_checkpoint.py, run_main) on tiny
local checkpoints whose character tokenizer has a chat template (and one whose has none): a `prompt` line is raw
text, a `messages` line is templated, an OpenAI request file is answered in OpenAI's output form and resumes; and
the flag combinations refused up front."""
from __future__ import annotations

import json
import os

import pytest

from flexgen_h2o.loader import load_model
from tests.tiny_checkpoint import char_tokenizer, cli_env, environment, make_checkpoint, run_main

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
HI = [{"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("forms")
    chat = make_checkpoint(root / "tinychat")
    tok = char_tokenizer()
    tok.chat_template = TEMPLATE
    tok.save_pretrained(chat)
    plain = make_checkpoint(root / "tinyplain")
    env = cli_env(root / "home")
    with environment(env):
        templated = load_model(str(chat), progress=False).tokenizer
        load_model(str(plain), progress=False)
    return chat, plain, templated, env


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _read(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def _run(ckpt, env, inp, out, *more):
    proc = run_main(["--model", str(ckpt), "--input", str(inp), "--output", str(out), "--gen-len", "6",
                     "--gpu-batch-size", "2", "--no-progress", *more], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_prompt_is_raw_and_messages_are_templated(models, tmp_path):
    chat, _, tok, env = models
    templated_text = "[user]hi there[assistant]"
    want = tok.apply_chat_template(HI, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tok.decode(want) == templated_text
    rows = [{"prompt": "hi there", "id": "raw"}, {"messages": HI, "id": "chat"},
            {"prompt": templated_text, "id": "preformatted"}]
    out = tmp_path / "out.jsonl"
    _run(chat, env, _jsonl(tmp_path / "in.jsonl", rows), out)
    raw, msgs, pre = _read(out)
    assert raw["prompt_tokens"] == len(tok.encode("hi there")) == 8                  # no template around it
    assert msgs["prompt_tokens"] == len(want) == 25
    assert pre["prompt_tokens"] == len(tok.encode(templated_text)) == 25             # not templated twice
    assert msgs["token_ids"] == pre["token_ids"] and msgs["text"] == pre["text"]     # the model saw the same ids
    assert msgs["messages"] == HI and "prompt" not in msgs
    assert (raw["prompt"], pre["prompt"]) == ("hi there", templated_text) and "messages" not in raw


def _openai_rows():
    chat = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "gpt-4o-mini", "messages": [{"role": "system", "content": "Be brief."},
                                                            {"role": "user", "content": q}], "max_tokens": n}}
            for i, (q, n) in enumerate([("Name a colour.", 4), ("Count to three", 6), ("Why?", 5)])]
    text = {"custom_id": "t0", "method": "POST", "url": "/v1/completions",
            "body": {"model": "davinci-002", "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}}
    return chat + [text]


def test_openai_file_gets_openai_output_and_resumes(models, tmp_path):
    chat, _, tok, env = models
    rows = _openai_rows()
    inp, out = _jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    _run(chat, env, inp, out)
    recs = _read(out)
    assert [r["custom_id"] for r in recs] == ["c0", "c1", "c2", "t0"]
    # the same requests in our own form give the same tokens: compare the answers
    own = _jsonl(tmp_path / "own.jsonl", [{"messages": r["body"]["messages"], "max_new_tokens": r["body"]["max_tokens"]}
                                          for r in rows[:3]] + [{"prompt": "Once upon a time", "max_new_tokens": 3}])
    _run(chat, env, own, tmp_path / "own_out.jsonl")
    mine = _read(tmp_path / "own_out.jsonl")
    for rec, row, ref in zip(recs, rows, mine):
        assert set(rec) == {"id", "custom_id", "response", "error"} and rec["error"] is None
        assert rec["id"].startswith("batch_req_") and rec["response"]["status_code"] == 200
        body = rec["response"]["body"]
        chat_line = row["url"] == "/v1/chat/completions"
        assert body["object"] == ("chat.completion" if chat_line else "text_completion")
        assert body["model"] == str(chat)
        (choice,) = body["choices"]
        if chat_line:
            assert choice["message"] == {"role": "assistant", "content": ref["text"]}
        else:
            assert choice["text"] == ref["text"]
        assert choice["finish_reason"] == {"eos": "stop", "stop": "stop", "length": "length"}[ref["finish_reason"]]
        assert body["usage"] == {"prompt_tokens": ref["prompt_tokens"], "completion_tokens": ref["completion_tokens"],
                                 "total_tokens": ref["prompt_tokens"] + ref["completion_tokens"]}
    assert recs[3]["response"]["body"]["usage"]["prompt_tokens"] == len(tok.encode("Once upon a time"))
    assert recs[0]["response"]["body"]["usage"]["prompt_tokens"] == len(
        tok.encode("[system]Be brief.[user]Name a colour.[assistant]"))
    # resume: two answers kept as they are, the other two generated again
    out.write_text("".join(json.dumps(recs[i]) + "\n" for i in (3, 1)))
    proc = _run(chat, env, inp, out)
    assert f"resuming {out}: 2 of 4 ids already done" in proc.stdout
    again = _read(out)
    assert [r["custom_id"] for r in again] == ["c0", "c1", "c2", "t0"]
    assert again[1] == recs[1] and again[3] == recs[3]
    assert again[0]["id"] != recs[0]["id"]                                          # answered anew
    assert again[0]["response"]["body"]["choices"] == recs[0]["response"]["body"]["choices"]   # greedy: same text
    # a changed request line is not resumed over (the run's own settings as before: only the line differs)
    rows[2]["body"]["max_tokens"] = 2
    proc = run_main(["--model", str(chat), "--input", str(_jsonl(inp, rows)), "--output", str(out), "--gen-len", "6"],
                    env)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: --output {out}: id \"c2\" (line 3) was generated for a different request line; use another "
        "--output or pass --overwrite"]
    assert _read(out) == again


def _refusals(tmp_path, chat, plain):
    msgs = _jsonl(tmp_path / "msgs.jsonl", [{"prompt": "fine"}, {"messages": HI}])
    mixed = _jsonl(tmp_path / "mixed.jsonl", [{"prompt": "fine"}, _openai_rows()[3]])
    hot = _jsonl(tmp_path / "hot.jsonl", [dict(_openai_rows()[3], body={"prompt": "a", "temperature": 0.7})])
    out = str(tmp_path / "out.jsonl")
    c, p = ["--model", str(chat)], ["--model", str(plain)]
    return [
        (c + ["--input", str(msgs), "--output", out, "--no-chat-template"],
         f"error: {msgs}: line 2: 'messages' needs the chat template, which --no-chat-template turns off; send the "
         "text as a prompt or drop the flag"),
        (p + ["--input", str(msgs), "--output", out],
         f"error: {msgs}: line 2: a chat (messages) needs a chat template, and the tokenizer of {plain} has none; "
         "send the text as a prompt"),
        (c + ["--input", str(mixed), "--output", out],
         f"error: {mixed}: line 2: an OpenAI batch request line, but line 1 is a \"prompt\"/\"messages\" line; one "
         "form per file (each has its own output form)"),
        (c + ["--input", str(hot), "--output", out],
         f"error: {hot}: line 1: body.temperature = 0.7 differs from this run's --temperature 0.0; one setting per "
         "run: pass it on the command line, or drop it from the line"),
        (c + ["--hh-ratio", "0.2", "--policy", "sink", "--h2o-variant", "avg"],
         "error: --h2o-variant avg is a variant of --policy h2o, not of --policy sink; drop one of them"),
        (c + ["--h2o-variant", "port"],
         "error: --h2o-variant port needs a KV budget (--hh-ratio, --hh-size, --kv-budget, ...); without one the "
         "cache is full and nothing is evicted"),
        (c + ["--policy", "local", "--full-cache"],
         "error: --policy local needs a KV budget (--hh-ratio, --hh-size, --kv-budget, ...); without one the cache "
         "is full and nothing is evicted"),
        (c + ["--cpu-cache-compute", "--device", "cpu"],
         "error: --cpu-cache-compute applies when the compute device is a GPU, and here it is the CPU (--device "
         "cpu); drop the flag"),
    ]


def test_refusals_one_line_exit_2_nothing_written(models, tmp_path):
    chat, plain, _, env = models
    for args, message in _refusals(tmp_path, chat, plain):
        before = sorted(os.listdir(tmp_path))
        proc = run_main(args + ["--metrics-json", str(tmp_path / "m.json"), "--log-file", str(tmp_path / "l.log")],
                        env)
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        assert proc.stderr.strip().splitlines() == [message], (args, proc.stderr)
        assert proc.stdout == ""
        assert sorted(os.listdir(tmp_path)) == before, args
