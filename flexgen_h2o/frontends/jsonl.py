"""Batch JSONL in and out: strict input parsing, block-by-block atomic appends, resume by id, input order.

Input: one JSON object per line: `prompt` (string), optional `id` (string or integer; default: the line
number), optional `max_new_tokens` (integer >= 1). Blank lines are skipped. Anything else fails with the line
number before any compute.

Output: one JSON object per input: id, prompt, text, finish_reason, prompt_tokens, completion_tokens, token_ids.
During a run each finished block is appended with a single write() of whole lines and fsync'd, so a crash
(even SIGKILL) leaves only whole lines, in completion (bucket) order. When every id is done the file is
rewritten in input order through a temporary file and an atomic rename. Rerunning with the same output skips
the ids already there; a torn last line (power loss mid-write) is dropped and redone.
Stdlib only: the CLI reads and checks everything here before importing torch.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from flexgen_h2o.config import ConfigError

INPUT_KEYS = ("prompt", "id", "max_new_tokens")


@dataclass
class Request:
    id: Any                          # the line's id, or its line number
    prompt: str
    max_new_tokens: int
    line: int                        # 1-based line number in the input file

    @property
    def key(self) -> str:
        """Ids compare by their JSON form, so 3 and "3" stay different ids."""
        return json.dumps(self.id)


def _bad(path: str | os.PathLike, line: int, why: str) -> ConfigError:
    return ConfigError(f"{path}: line {line}: {why}")


def read_requests(path: str | os.PathLike, default_max_new: int) -> list[Request]:
    """Parse and check every line; the first problem raises ConfigError naming its line."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read --input {path}: {e.strerror or e}") from None
    requests: list[Request] = []
    seen: dict[str, int] = {}
    for n, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _bad(path, n, f"not valid JSON ({getattr(e, 'msg', None) or e})") from None
        if not isinstance(obj, dict):
            raise _bad(path, n, f"expected a JSON object with a \"prompt\", got {type(obj).__name__}")
        unknown = sorted(set(obj) - set(INPUT_KEYS))
        if unknown:
            raise _bad(path, n, f"unknown key(s) {', '.join(map(repr, unknown))}; accepted: {', '.join(INPUT_KEYS)}")
        prompt = obj.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise _bad(path, n, "\"prompt\" must be a non-empty string")
        rid = obj.get("id", n)
        if isinstance(rid, bool) or not isinstance(rid, (str, int)):
            raise _bad(path, n, f"\"id\" must be a string or an integer, got {json.dumps(rid)}")
        max_new = obj.get("max_new_tokens", default_max_new)
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
            raise _bad(path, n, f"\"max_new_tokens\" must be an integer >= 1, got {json.dumps(max_new)}")
        req = Request(rid, prompt, max_new, n)
        if req.key in seen:
            raise _bad(path, n, f"id {req.key} was already used on line {seen[req.key]}")
        seen[req.key] = n
        requests.append(req)
    if not requests:
        raise ConfigError(f"{path}: no prompts (expected one JSON object per line)")
    return requests


def check_writable(path: str | os.PathLike, flag: str) -> None:
    """Fail early, writing nothing, when `path` cannot be created or replaced."""
    p = Path(path).expanduser()
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise ConfigError(f"{flag} {path} is a directory")
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path}: folder {parent} does not exist")
    try:   # a real probe: permission bits say nothing for root or a read-only mount
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=parent)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{flag} {path} is not writable: {e.strerror or e}") from None
    if p.exists() and not os.access(p, os.W_OK):
        raise ConfigError(f"{flag} {path} is not writable")


def check_folder_writable(path: str | os.PathLike, flag: str) -> None:
    """A folder that may not exist yet: its nearest existing ancestor must be a writable folder. Creates
    nothing (the engine makes the folder when it runs)."""
    p = Path(path).expanduser().absolute()
    anc = p
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise ConfigError(f"{flag} {path}: {anc} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=anc)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{flag} {path} is not writable: {e.strerror or e}") from None


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class ResultsFile:
    """The output JSONL: what is done already, appends per block, and the final reorder."""

    def __init__(self, path: str | os.PathLike, *, overwrite: bool = False):
        self.path = Path(path).expanduser()
        self.done: dict[str, dict] = {}          # id key -> record, from earlier runs and this one
        self.repaired = False                    # a torn last line was dropped
        # --overwrite: an old file is truncated by the first block written, not before: an error before
        # any result leaves it untouched
        self._truncate_first = overwrite

    def load(self, requests: list[Request]) -> int:
        """Read an existing output (resume). Returns how many of `requests` are done. Lines must belong to this
        input: an id that is not in it, or a different prompt for the same id, stops the run."""
        if self._truncate_first or not self.path.exists():
            return 0
        raw = self.path.read_bytes()
        if raw and not raw.endswith(b"\n"):      # torn tail: our appends never do this, a power cut might
            raw = raw[:raw.rfind(b"\n") + 1]
            self.repaired = True
        by_key = {r.key: r for r in requests}
        for n, line in enumerate(raw.split(b"\n")[:-1], start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                key = json.dumps(rec["id"])
            except (json.JSONDecodeError, UnicodeDecodeError, TypeError, KeyError):
                raise ConfigError(f"--output {self.path}: line {n} is not a result line; not resuming over it "
                                  "(move the file away or pass --overwrite)") from None
            req = by_key.get(key)
            if req is None:
                raise ConfigError(f"--output {self.path}: line {n} has id {key}, which is not in the input; "
                                  "use another --output or pass --overwrite")
            if rec.get("prompt") != req.prompt:
                raise ConfigError(f"--output {self.path}: id {key} (line {n}) was generated for a different "
                                  "prompt; use another --output or pass --overwrite")
            self.done.setdefault(key, rec)
        if self.repaired:
            self._truncate(len(raw))
        return sum(1 for r in requests if r.key in self.done)

    def _truncate(self, size: int) -> None:
        with open(self.path, "r+b") as f:
            f.truncate(size)
            os.fsync(f.fileno())

    def append(self, records: Iterable[dict]) -> None:
        """Append whole lines with one write() and fsync them: a kill leaves the block in full or not at all."""
        recs = list(records)
        data = b"".join(json.dumps(r, ensure_ascii=False).encode("utf-8") + b"\n" for r in recs)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | (os.O_TRUNC if self._truncate_first else 0)
        fd = os.open(self.path, flags, 0o644)
        self._truncate_first = False
        try:
            view, written = memoryview(data), 0
            while written < len(data):       # a regular file takes it in one go; loop only for safety
                written += os.write(fd, view[written:])
            os.fsync(fd)
        finally:
            os.close(fd)
        for r in recs:
            self.done[json.dumps(r["id"])] = r

    def finalize(self, requests: list[Request]) -> None:
        """Rewrite the file in input order (temporary file, fsync, atomic rename)."""
        missing = [r.id for r in requests if r.key not in self.done]
        if missing:
            raise RuntimeError(f"ids {missing[:5]} have no result")
        data = b"".join(json.dumps(self.done[r.key], ensure_ascii=False).encode("utf-8") + b"\n"
                        for r in requests)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_dir(self.path.parent)


def record(req: Request, text: str, token_ids: list[int], finish_reason: str, prompt_tokens: int) -> dict:
    """One output line."""
    return {"id": req.id, "prompt": req.prompt, "text": text, "finish_reason": finish_reason,
            "prompt_tokens": prompt_tokens, "completion_tokens": len(token_ids), "token_ids": list(token_ids)}


def generate_file(llm: Any, requests: list[Request], pending: list[Request], ids: list[list[int]],
                  results: ResultsFile, gen: Any, *, input_name: str, progress: bool) -> dict:
    """Generate the pending requests block by block (bucketed), appending each block as it finishes; then
    put the whole file in input order. Returns the run's metrics (times and token counts)."""
    # sampling seeded by the request's place in the input (as LLM.generate seeds by list index), not by its
    # place in this run: a resumed id samples what it would have sampled uninterrupted
    position = {r.key: n for n, r in enumerate(requests)}
    blocks = llm.generate_blocks(ids, gen, [r.max_new_tokens for r in pending], progress=progress,
                                 label=lambda i: f"{input_name}: line {pending[i].line}",
                                 seeds=[position[r.key] for r in pending])
    for block in blocks:
        results.append(record(pending[i], text, toks, reason, len(ids[i]))
                       for i, toks, text, reason in zip(block.indices, block.token_ids, block.texts,
                                                        block.finish_reasons))
    results.finalize(requests)
    return dict(llm.last_metrics)
