"""Per-task checkpoint: <out>/<task>.json, rewritten atomically after every grid point.

A killed run restarts where it stopped: points already in the file are skipped. The file also records the
task's settings (item counts, lengths, model, ...); resuming with different settings would mix two experiments
in one table, so it is refused unless --fresh starts the task over.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from flexgen_h2o.config import ConfigError


class ResultStore:
    def __init__(self, out_dir: str | Path, task: str, meta: dict[str, Any], fresh: bool = False,
                 verbose: bool = False):
        self.verbose = verbose
        self.path = Path(out_dir) / f"{task}.json"
        self.task, self.meta = task, json.loads(json.dumps(meta))      # normalised as JSON would store it
        self.records: dict[str, dict] = {}
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

    def has(self, key: str) -> bool:
        return key in self.records

    def get(self, key: str) -> dict:
        return self.records[key]

    def put(self, key: str, record: dict) -> None:
        self.records[key] = record
        self.save()
        if self.verbose:
            print(f"{self.task} {key}: done in {record.get('seconds', 0):.0f} s", flush=True)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"task": self.task, "meta": self.meta, "records": self.records}, indent=1))
        os.replace(tmp, self.path)              # atomic: a kill mid-write leaves the previous checkpoint


def load_results(out_dir: str | Path, task: str) -> dict | None:
    path = Path(out_dir) / f"{task}.json"
    return json.loads(path.read_text()) if path.is_file() else None
