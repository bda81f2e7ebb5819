"""Per-task checkpoint: <out>/<task>.json, rewritten atomically after every grid point and every block of one.

A killed run restarts where it stopped: points already in the file are skipped, and so are the blocks of
unfinished points that were done (`partials`, kept until the point's record is written). The file also records the
task's settings (item counts, lengths, model, ...); resuming with different settings would mix two experiments
in one table, so it is refused unless --fresh starts the task over.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from flexgen_h2o.config import ConfigError


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write through a temporary file and an atomic rename: a reader or a kill never leaves half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class ResultStore:
    def __init__(self, out_dir: str | Path, task: str, meta: dict[str, Any], fresh: bool = False,
                 verbose: bool = False):
        self.verbose = verbose
        self.path = Path(out_dir) / f"{task}.json"
        self.task, self.meta = task, json.loads(json.dumps(meta))      # normalised as JSON would store it
        self.records: dict[str, dict] = {}
        self.partials: dict[str, dict[str, dict]] = {}       # point key -> block index -> that block's result
        if self.path.is_file() and not fresh:
            try:
                saved = json.loads(self.path.read_text())
            except json.JSONDecodeError as e:
                raise ConfigError(f"{self.path} is not valid JSON ({e}); pass --fresh to start this task "
                                  "over") from None
            if saved.get("meta") != self.meta:
                old = saved.get("meta") or {}
                diff = sorted(k for k in set(old) | set(self.meta) if old.get(k) != self.meta.get(k))
                raise ConfigError(f"{self.path} was made with other settings ({', '.join(diff)} differ); pass "
                                  f"--fresh to overwrite it or choose another --out")
            self.records = saved.get("records", {})
            self.partials = saved.get("partials", {})

    def has(self, key: str) -> bool:
        return key in self.records

    def get(self, key: str) -> dict:
        return self.records[key]

    def put(self, key: str, record: dict) -> None:
        self.records[key] = record
        self.partials.pop(key, None)
        self.save()
        if self.verbose:
            print(f"{self.task} {key}: done in {record.get('seconds', 0):.0f} s", flush=True)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # a kill mid-write leaves the previous checkpoint
        write_text_atomic(self.path, json.dumps({"task": self.task, "meta": self.meta, "records": self.records,
                                                 "partials": self.partials}, indent=1))


class BlockCheckpoint:
    """A ResultStore seen as the runner's Checkpoint: each finished (point, block) lands in its partials.
    prefix: the keys' namespace inside the task (e.g. the perplexity corpus)."""

    def __init__(self, store: ResultStore, prefix: str = ""):
        self.store, self.prefix = store, prefix

    def get(self, key: str, block: int) -> dict | None:
        return self.store.partials.get(self.prefix + key, {}).get(str(block))

    def put(self, key: str, block: int, value: dict) -> None:
        self.store.partials.setdefault(self.prefix + key, {})[str(block)] = value
        self.store.save()


def load_results(out_dir: str | Path, task: str) -> dict | None:
    path = Path(out_dir) / f"{task}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def merge_results(out_dir: str | Path, sources: list[str | Path]) -> list[str]:
    """Union the finished records of every task file in `sources` into <out_dir>/<task>.json, e.g. the points
    of one grid run as two processes side by side. A task's files must share their settings (meta), and a
    point measured in two files must hold the same record; unfinished points (partials) are not carried over.
    Returns the tasks written."""
    merged: dict[str, tuple[dict, dict]] = {}                   # task -> (meta, records)
    for src in sources:
        files = sorted(Path(src).glob("*.json"))
        if not files:
            raise FileNotFoundError(f"--merge: no task JSON in {src}")
        for path in files:
            saved = json.loads(path.read_text())
            if "task" not in saved or "records" not in saved:
                continue                                        # not a task checkpoint
            meta, records = merged.setdefault(saved["task"], (saved["meta"], {}))
            if saved["meta"] != meta:
                raise ConfigError(f"--merge: {path} was made with other settings than the first "
                                  f"{saved['task']} file; only runs of one experiment can be merged")
            for key, record in saved["records"].items():
                if key in records and records[key] != record:
                    raise ConfigError(f"--merge: point {key!r} differs between two {saved['task']} files")
                records[key] = record
    for task, (meta, records) in merged.items():
        store = ResultStore(out_dir, task, meta, fresh=True)
        store.records = records
        store.save()
    return sorted(merged)
