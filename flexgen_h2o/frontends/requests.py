"""The input forms of a batch file, and the output line each form is answered with.

- `{"prompt": "...", "id"?, "max_new_tokens"?}`: raw text, never templated (as vLLM's LLM.generate and
  OpenAI's completions treat a prompt; a pre-formatted prompt must not be templated twice);
- `{"messages": [{"role", "content"}, ...], "id"?, "max_new_tokens"?}`: a chat, through the tokenizer's chat
  template with the assistant turn opened;
- OpenAI Batch API request lines, as they are: `{"custom_id", "method": "POST", "url": "/v1/chat/completions" or
  "/v1/completions", "body": {...}}`, answered with OpenAI's output lines.

`prompt` and `messages` lines mix in one file; OpenAI lines do not mix with them (each form has its own output).
Every line is checked before any compute; the first problem names its line. Stdlib only: the CLI reads and
checks the file before importing torch.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from flexgen_h2o.config import ConfigError

INPUT_KEYS = ("prompt", "messages", "id", "max_new_tokens")
OPENAI_KEYS = ("custom_id", "method", "url", "body")
CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
ROLES = ("system", "user", "assistant")
# the run's sampling settings when the caller gives none (GenerationConfig's defaults)
DEFAULT_SAMPLING: Mapping[str, Any] = {"temperature": 0.0, "top_p": 1.0, "seed": 0, "stop": ()}
# body keys whose value leaves the output as it is: accepted at these values (or null), refused otherwise
NEUTRAL = {"n": 1, "stream": False, "logprobs": False, "echo": False, "best_of": 1,
           "frequency_penalty": 0, "presence_penalty": 0}
IGNORED = ("model", "user")          # the model is --model; `user` is a tag for OpenAI's abuse monitoring


@dataclass
class Request:
    id: Any                          # the line's id (OpenAI form: custom_id), or its line number
    prompt: str | None               # raw text; None for a chat
    max_new_tokens: int
    line: int                        # 1-based line number in the input file
    messages: list[dict] | None = None   # a chat: [{"role", "content"}, ...]
    url: str | None = None           # OpenAI form: the endpoint the line names; None for our own form
    fingerprint: str = ""            # OpenAI form: hash of the request line; the output keeps it for resume

    @property
    def key(self) -> str:
        """The id's JSON form: an output line answers the id it names, 3 or "3", exactly."""
        return json.dumps(self.id)

    @property
    def text_id(self) -> str:
        """The id as text: two ids that read alike (3 and "3") are one id to any reader that keys by text, so a
        file holding both is refused."""
        return str(self.id)


def read_requests(path: str | os.PathLike, default_max_new: int, *, sampling: Mapping[str, Any] | None = None,
                  chat_template: bool = True) -> list[Request]:
    """Parse and check every line; the first problem raises ConfigError naming its line. `sampling` is the
    run's temperature, top_p, seed and stop, which an OpenAI body must agree with (one setting per run);
    `chat_template=False` (--no-chat-template) makes chat lines an error."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read --input {path}: {e.strerror or e}") from None
    run = {**DEFAULT_SAMPLING, **(sampling or {})}
    requests: list[Request] = []
    seen: dict[str, tuple[str, int]] = {}        # id as text -> (its JSON form, line)
    first: tuple[bool, int] | None = None        # (OpenAI form?, line) of the first line: the file's form
    for n, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"not valid JSON ({getattr(e, 'msg', None) or e})") from None
            if not isinstance(obj, dict):
                raise ValueError("expected a JSON object with a \"prompt\", \"messages\" or an OpenAI \"body\", got "
                                 + type(obj).__name__)
            openai = any(k in obj for k in OPENAI_KEYS)
            if first is None:
                first = (openai, n)
            elif openai != first[0]:
                raise ValueError(f"{_form(openai)} line, but line {first[1]} is {_form(first[0])} line; one form "
                                 "per file (each has its own output form)")
            req = _openai_line(obj, n, default_max_new, run) if openai else _own_line(obj, n, default_max_new)
            if req.messages is not None and not chat_template:
                raise ValueError(f"{'body.messages' if openai else repr('messages')} needs the chat template, "
                                 "which --no-chat-template turns off; send the text as a prompt or drop the flag")
            if req.text_id in seen:
                name = "custom_id" if openai else "id"
                was, at = seen[req.text_id]
                if was == req.key:
                    raise ValueError(f"{name} {req.key} was already used on line {at}")
                raise ValueError(f"{name} {req.key} reads as the {name} {was} of line {at}; ids must differ as text")
        except ValueError as e:
            raise ConfigError(f"{path}: line {n}: {e}") from None
        seen[req.text_id] = (req.key, n)
        requests.append(req)
    if not requests:
        raise ConfigError(f"{path}: no prompts (expected one JSON object per line)")
    return requests


def _form(openai: bool) -> str:
    return "an OpenAI batch request" if openai else "a \"prompt\"/\"messages\""


def _own_line(obj: dict, n: int, default_max_new: int) -> Request:
    unknown = sorted(set(obj) - set(INPUT_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))}; accepted: {', '.join(INPUT_KEYS)} (or an "
                         "OpenAI batch request line)")
    if "prompt" in obj and "messages" in obj:
        raise ValueError("give \"prompt\" (raw text) or \"messages\" (a chat), not both")
    prompt = messages = None
    if "messages" in obj:
        messages = _messages(obj["messages"], "\"messages\"")
    elif "prompt" in obj:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("\"prompt\" must be a non-empty string")
    else:
        raise ValueError("needs \"prompt\" (raw text) or \"messages\" (a chat)")
    rid = obj.get("id", n)
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        raise ValueError(f"\"id\" must be a string or an integer, got {json.dumps(rid)}")
    return Request(rid, prompt, _max_new(obj.get("max_new_tokens", default_max_new), "\"max_new_tokens\""), n,
                   messages=messages)


def _messages(value: Any, where: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where} must be a non-empty list of {{\"role\", \"content\"}} objects")
    for i, m in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{at} must be an object with \"role\" and \"content\", got {type(m).__name__}")
        unknown = sorted(set(m) - {"role", "content"})
        if unknown:
            raise ValueError(f"{at} has unknown key(s) {', '.join(map(repr, unknown))}; a message has \"role\" and "
                             "\"content\"")
        if m.get("role") not in ROLES:
            raise ValueError(f"{at}.role must be one of {', '.join(ROLES)}, got {json.dumps(m.get('role'))}")
        if not isinstance(m.get("content"), str):
            parts = " (content parts are not supported: give the text as one string)" \
                if isinstance(m.get("content"), list) else ""
            raise ValueError(f"{at}.content must be a string{parts}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _max_new(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where} must be an integer >= 1, got {json.dumps(value)}")
    return value


def _openai_line(obj: dict, n: int, default_max_new: int, run: Mapping[str, Any]) -> Request:
    unknown = sorted(set(obj) - set(OPENAI_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))} in an OpenAI batch request line; "
                         f"accepted: {', '.join(OPENAI_KEYS)}")
    missing = [k for k in OPENAI_KEYS if k not in obj]
    if missing:
        raise ValueError(f"an OpenAI batch request line needs {', '.join(map(repr, missing))}")
    cid = obj["custom_id"]
    if not isinstance(cid, str) or not cid:
        raise ValueError(f"\"custom_id\" must be a non-empty string, got {json.dumps(cid)}")
    if obj["method"] != "POST":
        raise ValueError(f"\"method\" must be \"POST\", got {json.dumps(obj['method'])}")
    url, body = obj["url"], obj["body"]
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise ValueError(f"\"url\" must be {CHAT_URL} or {COMPLETIONS_URL}, got {json.dumps(url)}")
    if not isinstance(body, dict):
        raise ValueError("\"body\" must be an object")
    chat = url == CHAT_URL
    text_key = "messages" if chat else "prompt"
    limit_keys = ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",)
    known = (text_key, *limit_keys, *DEFAULT_SAMPLING, *NEUTRAL, *IGNORED)
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise ValueError(f"body key(s) {', '.join(map(repr, unknown))} not supported for {url}; accepted: "
                         f"{', '.join(known)}")
    if text_key not in body:
        raise ValueError(f"{url} needs body.{text_key}")
    messages = prompt = None
    if chat:
        messages = _messages(body["messages"], "body.messages")
    else:
        prompt = body["prompt"]
        if isinstance(prompt, list):
            raise ValueError("body.prompt must be one string: a list of prompts or of token ids is not supported "
                             "(one request per line)")
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("body.prompt must be a non-empty string")
    limits = [k for k in limit_keys if body.get(k) is not None]
    if len(limits) > 1:
        raise ValueError("give one of body.max_tokens and body.max_completion_tokens")
    max_new = _max_new(body[limits[0]], f"body.{limits[0]}") if limits else default_max_new
    for key, neutral in NEUTRAL.items():
        if body.get(key) is not None and body[key] != neutral:
            raise ValueError(f"body.{key} = {json.dumps(body[key])} is not supported (only {json.dumps(neutral)})")
    _check_sampling(body, run)
    # any change to the line means a different request; key order and spacing do not
    canon = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return Request(cid, prompt, max_new, n, messages=messages, url=url,
                   fingerprint=hashlib.sha256(canon.encode("utf-8")).hexdigest()[:32])


def _check_sampling(body: dict, run: Mapping[str, Any]) -> None:
    """The engine samples every line of a run with one setting, so a body may only restate the command line's.
    An absent (or null) field takes the command line's value, not OpenAI's default (temperature 1)."""
    flag = {"temperature": "--temperature", "top_p": "--top-p", "seed": "--seed"}
    for key in ("temperature", "top_p"):
        v = body.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ValueError(f"body.{key} must be a number, got {json.dumps(v)}")
    seed, stop = body.get("seed"), body.get("stop")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"body.seed must be an integer, got {json.dumps(seed)}")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise ValueError("body.stop must be a string or a list of non-empty strings")
    line = {"temperature": body.get("temperature"), "top_p": body.get("top_p"), "seed": seed,
            "stop": None if stop is None else sorted(set(stop))}
    want = dict(run, stop=sorted(set(run["stop"])))
    greedy = float(run["temperature"]) == 0.0
    for key, v in line.items():
        if v is None or v == want[key] or (greedy and key in ("top_p", "seed")):    # greedy ignores both
            continue
        if key == "stop":
            shown = " ".join(f"--stop {json.dumps(s)}" for s in want["stop"]) or "no --stop"
        else:
            shown = f"{flag[key]} {want[key]}"
        raise ValueError(f"body.{key} = {json.dumps(body[key])} differs from this run's {shown}; one setting per "
                         "run: pass it on the command line, or drop it from the line")


def result_key(rec: Any) -> str:
    """The id key of an output line: custom_id in OpenAI's form, else id. Raises KeyError or TypeError when
    `rec` is no result line."""
    if not isinstance(rec, dict):
        raise TypeError("not an object")
    return json.dumps(rec["custom_id"] if "custom_id" in rec else rec["id"])


def same_request(rec: dict, req: Request) -> bool:
    """Whether an output line (from an earlier run) answers this request, for resume."""
    if req.url is not None:
        resp = rec.get("response")
        return isinstance(resp, dict) and resp.get("request_id") == "req_" + req.fingerprint
    # a line's own max_new_tokens changes its answer (the run's default is in the settings record); a line
    # written before it was recorded answers any
    if rec.get("max_new_tokens", req.max_new_tokens) != req.max_new_tokens:
        return False
    if req.messages is not None:
        return rec.get("messages") == req.messages and "prompt" not in rec
    return rec.get("prompt") == req.prompt and "messages" not in rec


def record(req: Request, text: str, token_ids: list[int], finish_reason: str, prompt_tokens: int, *,
           model: str = "") -> dict:
    """One output line: our own fields, or OpenAI's output line for an OpenAI request."""
    if req.url is not None:
        return _openai_record(req, text, len(token_ids), finish_reason, prompt_tokens, model)
    rec: dict[str, Any] = {"id": req.id}
    if req.messages is not None:
        rec["messages"] = req.messages
    else:
        rec["prompt"] = req.prompt
    rec.update(max_new_tokens=req.max_new_tokens, text=text, finish_reason=finish_reason, prompt_tokens=prompt_tokens,
               completion_tokens=len(token_ids), token_ids=list(token_ids))
    return rec


def _openai_record(req: Request, text: str, n_tokens: int, finish_reason: str, prompt_tokens: int,
                   model: str) -> dict:
    chat = req.url == CHAT_URL
    choice: dict[str, Any] = {"index": 0}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    # OpenAI has no "eos": the model stopping and a stop string are both "stop"
    choice.update(logprobs=None, finish_reason="length" if finish_reason == "length" else "stop")
    body = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n_tokens,
                      "total_tokens": prompt_tokens + n_tokens}}
    return {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": req.id,
            "response": {"status_code": 200, "request_id": "req_" + req.fingerprint, "body": body}, "error": None}
