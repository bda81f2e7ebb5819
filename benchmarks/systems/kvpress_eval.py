"""The accuracy harness's bridge to kvpress: `python -m flexgen_h2o.eval --policies ...,kvpress-snapkv` reaches this
module through flexgen_h2o/eval/peers.py (an importlib lookup: the library never imports benchmarks), and it runs
kvpress_eval_child.py in the kvpress virtualenv (kvpress.py's ensure_venv creates it; this module never runs pip).

One child per grid point: its model loads once (about 10 s of imports and weights), then it runs the point's items
one at a time and prints each as a line, which `run_items` hands to the caller as it comes, so the harness
checkpoints every finished block while the child goes on.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable

from benchmarks.systems.kvpress import KVPRESS_SPEC, venv_dir, venv_python

CHILD = Path(__file__).resolve().parent / "kvpress_eval_child.py"
CREATE = "python -c 'from benchmarks.systems.kvpress import ensure_venv; print(ensure_venv() or \"ready\")'"


def venv_reason() -> str | None:
    """None when the kvpress virtualenv is ready, else why not and how to create it."""
    if venv_python().is_file() and (venv_dir() / ".ready").is_file():
        return None
    return (f"the kvpress rows run {KVPRESS_SPEC} in its own virtualenv, and there is none at {venv_dir()}: create "
            f"it from the repository root with {CREATE}")


def run_items(store: Path, press: str, items: list[dict[str, Any]], eos_id: int | None,
              on_item: Callable[[dict[str, Any], dict[str, Any]], None],
              params: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run `items` ({"prompt", "forced", "max_new", "keep"}, kvpress_eval_child.py's format) under kvpress's
    `press` (snapkv, tova, adakv, observed) on the store's model. on_item(item, meta) gets each finished item
    (with its "index") as the child prints it, and the child's meta (press, parameters, versions), which it
    also returns. Raises RuntimeError when the child fails; the child is stopped and the temporary folder
    removed on every exit."""
    reason, py = venv_reason(), venv_python()
    if reason:
        raise RuntimeError(reason)
    spec = {"store": str(store), "press": press, "eos_id": eos_id, "items": items}
    if params:
        spec["params"] = params
    with tempfile.TemporaryDirectory(prefix="kvpress_eval_") as tmp:
        inp, out, err = Path(tmp) / "in.json", Path(tmp) / "out.json", Path(tmp) / "stderr.txt"
        inp.write_text(json.dumps(spec))
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        meta: dict[str, Any] = {}
        with open(err, "w") as errf:
            proc = subprocess.Popen([str(py), str(CHILD), "--input", str(inp), "--json", str(out)], env=env,
                                    stdout=subprocess.PIPE, stderr=errf, text=True)
            try:
                assert proc.stdout is not None
                for line in proc.stdout:
                    kind, _, body = line.partition(" ")
                    if kind == "meta":
                        meta = json.loads(body)
                    elif kind == "item":
                        on_item(json.loads(body), meta)
                rc = proc.wait()
            finally:                    # an exception or Ctrl-C in on_item: the child does not outlive us
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if rc != 0:
            tail = "\n".join(err.read_text().strip().splitlines()[-20:]) or "(no stderr)"
            raise RuntimeError(f"kvpress eval child ({press}) failed with exit status {rc}:\n{tail}")
        return meta
