"""Batch input forms (frontends/requests.py): `prompt` and `messages` lines, OpenAI Batch API request lines, every
refusal with its line number, the output line of each form, and resume over each form's output."""
from __future__ import annotations

import json
import re

import pytest

from flexgen_h2o.config import ConfigError
from flexgen_h2o.frontends.jsonl import ResultsFile
from flexgen_h2o.frontends.requests import read_requests, record

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
GREEDY = {"temperature": 0.0, "top_p": 1.0, "seed": 0, "stop": []}


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _chat_line(cid="a", **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o-mini", "messages": CHAT, **body}}


def _completion_line(cid="b", **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"model": "gpt-3.5-turbo-instruct", "prompt": "Once upon", **body}}


def test_prompt_and_messages_lines_mix(tmp_path):
    path = _write(tmp_path / "in.jsonl", [{"prompt": "<|im_start|>user\nraw"}, "",
                                          {"messages": CHAT, "id": "c", "max_new_tokens": 3}])
    a, b = read_requests(path, 7)
    assert (a.id, a.prompt, a.messages, a.max_new_tokens, a.line, a.url) == (1, "<|im_start|>user\nraw", None, 7, 1,
                                                                               None)
    assert (b.id, b.prompt, b.messages, b.max_new_tokens, b.line, b.url) == ("c", None, CHAT, 3, 3, None)


def test_openai_lines(tmp_path):
    path = _write(tmp_path / "in.jsonl", [_chat_line(max_tokens=5), _chat_line("a2", max_completion_tokens=6),
                                          _completion_line(), _chat_line("a3", max_tokens=None)])
    reqs = read_requests(path, 9)
    assert [(r.id, r.prompt, r.messages, r.max_new_tokens, r.line, r.url) for r in reqs] == [
        ("a", None, CHAT, 5, 1, "/v1/chat/completions"), ("a2", None, CHAT, 6, 2, "/v1/chat/completions"),
        ("b", "Once upon", None, 9, 3, "/v1/completions"), ("a3", None, CHAT, 9, 4, "/v1/chat/completions")]
    assert [r.key for r in reqs] == ['"a"', '"a2"', '"b"', '"a3"']
    assert all(re.fullmatch(r"[0-9a-f]{32}", r.fingerprint) for r in reqs)
    assert len({r.fingerprint for r in reqs}) == 4


def test_fingerprint_is_the_request_not_its_spelling(tmp_path):
    line = _chat_line(max_tokens=5, temperature=0)
    spaced = json.dumps(line, indent=None, separators=(" ,  ", " :  "))
    reordered = json.dumps(dict(reversed(list(line.items()))))
    changed = _chat_line(max_tokens=6, temperature=0)
    fps = [read_requests(_write(tmp_path / f"{i}.jsonl", [row]), 1)[0].fingerprint
           for i, row in enumerate([line, spaced, reordered, changed])]
    assert fps[0] == fps[1] == fps[2] != fps[3]


def test_sampling_fields_that_agree_with_the_run_are_accepted(tmp_path):
    rows = [_chat_line(temperature=0.7, top_p=0.9, seed=5, stop=["\n", "END"]),     # stop strings in any order
            _completion_line("b2", n=1, stream=False, logprobs=None, user="u1", frequency_penalty=0)]
    run = {"temperature": 0.7, "top_p": 0.9, "seed": 5, "stop": ["END", "\n"]}
    assert len(read_requests(_write(tmp_path / "in.jsonl", rows), 4, sampling=run)) == 2
    one_stop = _write(tmp_path / "s.jsonl", [_completion_line(stop="END")])        # OpenAI's single-string form
    assert len(read_requests(one_stop, 4, sampling=dict(GREEDY, stop=["END"]))) == 1
    # greedy ignores top_p and seed, so any value is the run's output; absent fields take the run's values
    greedy = _write(tmp_path / "g.jsonl", [_chat_line(top_p=0.5, seed=99), _completion_line()])
    assert len(read_requests(greedy, 4, sampling=GREEDY)) == 2
    assert len(read_requests(greedy, 4)) == 2                      # no sampling given: GenerationConfig's defaults


@pytest.mark.parametrize("line, why", [
    # our own forms
    ({"prompt": "a", "messages": CHAT}, "give \"prompt\" (raw text) or \"messages\" (a chat), not both"),
    ({"id": "x"}, "needs \"prompt\" (raw text) or \"messages\" (a chat)"),
    ({"messages": []}, "\"messages\" must be a non-empty list of {\"role\", \"content\"} objects"),
    ({"messages": "Hi"}, "\"messages\" must be a non-empty list"),
    ({"messages": ["Hi"]}, "\"messages\"[0] must be an object with \"role\" and \"content\", got str"),
    ({"messages": [{"role": "user", "content": "a", "name": "bob"}]},
     "\"messages\"[0] has unknown key(s) 'name'; a message has \"role\" and \"content\""),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]},
     "\"messages\"[1].role must be one of system, user, assistant, got \"tool\""),
    ({"messages": [{"content": "a"}]}, "\"messages\"[0].role must be one of system, user, assistant, got null"),
    ({"messages": [{"role": "user", "content": 3}]}, "\"messages\"[0].content must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]},
     "\"messages\"[0].content must be a string (content parts are not supported"),
    ({"messages": CHAT, "max_new_tokens": -1}, "\"max_new_tokens\" must be an integer >= 1, got -1"),
    ({"prompt": "a", "custom": 1}, "unknown key(s) 'custom'; accepted: prompt, messages, id, max_new_tokens"),
    # OpenAI request lines
    (dict(_chat_line("dup")), "custom_id \"dup\" was already used on line 1"),
    ({"custom_id": "z", "url": "/v1/completions", "body": {"prompt": "a"}}, "needs 'method'"),
    (dict(_chat_line("z"), priority=1), "unknown key(s) 'priority' in an OpenAI batch request line"),
    (dict(_chat_line("z"), custom_id=7), "\"custom_id\" must be a non-empty string, got 7"),
    (dict(_chat_line("z"), custom_id=""), "\"custom_id\" must be a non-empty string"),
    (dict(_chat_line("z"), method="GET"), "\"method\" must be \"POST\", got \"GET\""),
    (dict(_chat_line("z"), url="/v1/embeddings"),
     "\"url\" must be /v1/chat/completions or /v1/completions, got \"/v1/embeddings\""),
    (dict(_chat_line("z"), body=["a"]), "\"body\" must be an object"),
    ({"custom_id": "z", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}},
     "/v1/chat/completions needs body.messages"),
    ({"custom_id": "z", "method": "POST", "url": "/v1/chat/completions", "body": {"prompt": "a"}},
     "body key(s) 'prompt' not supported for /v1/chat/completions"),
    (_chat_line("z", tools=[]), "body key(s) 'tools' not supported for /v1/chat/completions; accepted: messages"),
    (_completion_line("z", max_completion_tokens=3), "body key(s) 'max_completion_tokens' not supported for "
                                                     "/v1/completions"),
    (_chat_line("z", messages=[{"role": "developer", "content": "a"}]),
     "body.messages[0].role must be one of system, user, assistant, got \"developer\""),
    (_completion_line("z", prompt=["a", "b"]), "body.prompt must be one string: a list of prompts or of token ids"),
    (_completion_line("z", prompt=""), "body.prompt must be a non-empty string"),
    (_chat_line("z", max_tokens=4, max_completion_tokens=4), "give one of body.max_tokens and "
                                                             "body.max_completion_tokens"),
    (_chat_line("z", max_tokens=0), "body.max_tokens must be an integer >= 1, got 0"),
    (_chat_line("z", max_completion_tokens=2.5), "body.max_completion_tokens must be an integer >= 1, got 2.5"),
    (_chat_line("z", n=2), "body.n = 2 is not supported (only 1)"),
    (_chat_line("z", stream=True), "body.stream = true is not supported (only false)"),
    (_completion_line("z", presence_penalty=0.5), "body.presence_penalty = 0.5 is not supported (only 0)"),
    (_chat_line("z", temperature=1), "body.temperature = 1 differs from this run's --temperature 0.0; one setting "
                                     "per run: pass it on the command line, or drop it from the line"),
    (_chat_line("z", temperature="0"), "body.temperature must be a number, got \"0\""),
    (_chat_line("z", top_p=True), "body.top_p must be a number, got true"),
    (_chat_line("z", seed=1.5), "body.seed must be an integer, got 1.5"),
    (_completion_line("z", stop="\n"), "body.stop = \"\\n\" differs from this run's no --stop"),
    (_completion_line("z", stop=[1]), "body.stop must be a string or a list of non-empty strings"),
])
def test_bad_line_names_its_number(tmp_path, line, why):
    openai = "custom_id" in line or "method" in line
    first = [_chat_line("dup"), _completion_line("ok")] if openai else [{"prompt": "ok"}, {"messages": CHAT}]
    path = _write(tmp_path / "in.jsonl", [*first, line])
    with pytest.raises(ConfigError) as e:
        read_requests(path, 4, sampling=GREEDY)
    msg = str(e.value)
    assert msg.startswith(f"{path}: line 3: ") and why in msg, msg
    assert "\n" not in msg


@pytest.mark.parametrize("run, line, why", [
    (dict(GREEDY, temperature=0.8), _chat_line(temperature=0.8, top_p=0.5),
     "body.top_p = 0.5 differs from this run's --top-p 1.0"),
    (dict(GREEDY, temperature=0.8, seed=3), _chat_line(seed=4), "body.seed = 4 differs from this run's --seed 3"),
    (dict(GREEDY, stop=["A", "B"]), _chat_line(stop=["A"]), "body.stop = [\"A\"] differs from this run's --stop "
                                                            "\"A\" --stop \"B\""),
])
def test_sampling_that_differs_from_the_run_is_refused(tmp_path, run, line, why):
    path = _write(tmp_path / "in.jsonl", [line])
    with pytest.raises(ConfigError) as e:
        read_requests(path, 4, sampling=run)
    assert str(e.value).startswith(f"{path}: line 1: {why}")


@pytest.mark.parametrize("rows, why", [
    ([{"prompt": "a"}, {"prompt": "b"}, _chat_line()],
     "line 3: an OpenAI batch request line, but line 1 is a \"prompt\"/\"messages\" line; one form per file"),
    (["", _completion_line(), {"messages": CHAT}],
     "line 3: a \"prompt\"/\"messages\" line, but line 2 is an OpenAI batch request line; one form per file"),
])
def test_one_form_per_file(tmp_path, rows, why):
    path = _write(tmp_path / "in.jsonl", rows)
    with pytest.raises(ConfigError) as e:
        read_requests(path, 4)
    assert str(e.value).startswith(f"{path}: {why}")


def test_no_chat_template_refuses_chats_only(tmp_path):
    plain = _write(tmp_path / "plain.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    assert [r.prompt for r in read_requests(plain, 4, chat_template=False)] == ["a", "b"]
    assert read_requests(_write(tmp_path / "c.jsonl", [_completion_line()]), 4, chat_template=False)[0].prompt \
        == "Once upon"
    for rows, where in (([{"prompt": "a"}, {"messages": CHAT}], "'messages'"), ([_chat_line()], "body.messages")):
        path = _write(tmp_path / "in.jsonl", rows)
        with pytest.raises(ConfigError) as e:
            read_requests(path, 4, chat_template=False)
        assert str(e.value) == (f"{path}: line {len(rows)}: {where} needs the chat template, which "
                                "--no-chat-template turns off; send the text as a prompt or drop the flag")


# --- output lines ---

def test_own_form_records(tmp_path):
    a, b = read_requests(_write(tmp_path / "in.jsonl", [{"prompt": "p", "id": "x"}, {"messages": CHAT}]), 4)
    assert record(a, "t", [5, 6], "eos", 3, model="m") == {
        "id": "x", "prompt": "p", "max_new_tokens": 4, "text": "t", "finish_reason": "eos", "prompt_tokens": 3,
        "completion_tokens": 2, "token_ids": [5, 6]}
    assert record(b, "u", [7], "length", 9) == {
        "id": 2, "messages": CHAT, "max_new_tokens": 4, "text": "u", "finish_reason": "length", "prompt_tokens": 9,
        "completion_tokens": 1, "token_ids": [7]}


@pytest.mark.parametrize("ours, theirs", [("eos", "stop"), ("stop", "stop"), ("length", "length")])
def test_openai_records(tmp_path, ours, theirs):
    chat, comp = read_requests(_write(tmp_path / "in.jsonl", [_chat_line(), _completion_line()]), 4)
    rc = record(chat, "Hello!", [11, 12, 2], ours, 20, model="smollm2-135m")
    body = rc["response"]["body"]
    assert re.fullmatch(r"batch_req_[0-9a-f]{32}", rc["id"]) and re.fullmatch(r"chatcmpl-[0-9a-f]{32}", body["id"])
    assert isinstance(body["created"], int) and body["created"] > 1.7e9
    assert rc == {"id": rc["id"], "custom_id": "a", "error": None,
                  "response": {"status_code": 200, "request_id": "req_" + chat.fingerprint, "body": {
                      "id": body["id"], "object": "chat.completion", "created": body["created"],
                      "model": "smollm2-135m",
                      "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!"}, "logprobs": None,
                                   "finish_reason": theirs}],
                      "usage": {"prompt_tokens": 20, "completion_tokens": 3, "total_tokens": 23}}}}
    rt = record(comp, " a time", [4, 5], ours, 2, model="m")
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", rt["response"]["body"]["id"]) and rt["custom_id"] == "b"
    assert rt["response"]["body"]["object"] == "text_completion"
    assert rt["response"]["body"]["choices"] == [{"index": 0, "text": " a time", "logprobs": None,
                                                  "finish_reason": theirs}]
    assert rt["response"]["body"]["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    assert rt["id"] != rc["id"]


# --- resume over each form's output ---

def test_openai_output_resumes_by_custom_id_in_input_order(tmp_path):
    rows = [_chat_line(f"c{i}", max_tokens=i + 1) for i in range(3)] + [_completion_line("t")]
    reqs = read_requests(_write(tmp_path / "in.jsonl", rows), 4)
    out = ResultsFile(tmp_path / "out.jsonl")
    out.append([record(reqs[i], f"r{i}", [1], "eos", 2) for i in (3, 1)])
    again = ResultsFile(out.path)
    assert again.load(reqs) == 2 and set(again.done) == {'"t"', '"c1"'}
    again.append([record(reqs[i], f"r{i}", [1], "eos", 2) for i in (2, 0)])
    again.finalize(reqs)
    lines = [json.loads(x) for x in out.path.read_text().splitlines()]
    assert [r["custom_id"] for r in lines] == ["c0", "c1", "c2", "t"]
    assert [r["response"]["body"]["choices"][0].get("message", {}).get("content") for r in lines] == [
        "r0", "r1", "r2", None]
    # a changed request line (here max_tokens) is not the request that was answered
    rows[1] = _chat_line("c1", max_tokens=9)
    changed = read_requests(_write(tmp_path / "in2.jsonl", rows), 4)
    with pytest.raises(ConfigError) as e:
        ResultsFile(out.path).load(changed)
    assert str(e.value) == (f"--output {out.path}: id \"c1\" (line 2) was generated for a different request line; "
                            "use another --output or pass --overwrite")


def test_messages_output_resumes_and_checks_the_chat(tmp_path):
    reqs = read_requests(_write(tmp_path / "in.jsonl", [{"messages": CHAT, "id": "m"}, {"prompt": "p", "id": "p"}]), 4)
    out = ResultsFile(tmp_path / "out.jsonl")
    out.append([record(reqs[0], "t", [1], "eos", 2)])
    assert ResultsFile(out.path).load(reqs) == 1
    for rows in ([{"messages": CHAT[1:], "id": "m"}], [{"prompt": "Hi", "id": "m"}]):     # another chat; text
        other = read_requests(_write(tmp_path / "in2.jsonl", rows), 4)
        with pytest.raises(ConfigError, match=r"id \"m\" \(line 1\) was generated for a different prompt"):
            ResultsFile(out.path).load(other)


def test_output_of_the_other_form_is_refused(tmp_path):
    own = read_requests(_write(tmp_path / "own.jsonl", [{"prompt": "p", "id": "a"}]), 4)
    openai = read_requests(_write(tmp_path / "oa.jsonl", [_completion_line("a", prompt="p")]), 4)
    path = tmp_path / "out.jsonl"
    path.write_text(json.dumps(record(own[0], "t", [1], "eos", 1)) + "\n")
    with pytest.raises(ConfigError, match="different request line"):        # same id, but no OpenAI answer
        ResultsFile(path).load(openai)
    path.write_text(json.dumps(record(openai[0], "t", [1], "eos", 1)) + "\n")
    with pytest.raises(ConfigError, match="different prompt"):
        ResultsFile(path).load(own)
