"""A tiny local HF checkpoint (random Llama, GQA) with a character-level tokenizer, for CLI and API tests, and the
ways to run the CLI on it: in this process (run_main: flag checks, error lines, whole jobs) or in a subprocess
(run_cli, kill_once_written, kill_at_line: where the process boundary is the point, a SIGKILL and its resume).

The CLI takes a local folder as --model and converts it into a store under $FLEXGEN_H2O_HOME, tokenizer
included, so the tests run the real entry point offline. Every printable ASCII character is one token, which makes
prompt lengths exact and easy to choose. tests/conftest.py's `tiny` fixture converts it once per session.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

from tests.helpers import VOCAB, tiny_hf

REPO = Path(__file__).resolve().parents[1]
SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
# a batch job of twelve prompts from 19 to 69 characters (tokens), for the invariance, refill and scale-out tests
ROWS = [{"prompt": "Item %d: " % i + "abcdefghij" * (1 + (i * 7) % 6) + "?", "id": f"q{i}"} for i in range(12)]


def char_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for c in range(32, 127):
        vocab[chr(c)] = len(vocab)
    while len(vocab) < VOCAB:                       # the model's vocabulary is 128: name the spare ids
        vocab[f"<x{len(vocab)}>"] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")


def make_checkpoint(folder: Path) -> Path:
    """Random tiny Llama (2 layers, width 64, 4 query / 2 KV heads, context 512) + tokenizer in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    tiny_hf("llama").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


def cli_env(home: Path) -> dict[str, str]:
    """Offline, passive OpenMP, 2 threads, stores under `home` (never the user's cache)."""
    env = dict(os.environ, FLEXGEN_H2O_HOME=str(home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    env.pop("FLEXGEN_H2O_DEBUG", None)
    return env


def run_cli(args: list[str], env: dict[str, str], cwd: Path | None = None, timeout: float = 300,
            **kw) -> subprocess.CompletedProcess:
    """`python -m flexgen_h2o.run args` in a subprocess (the entry point itself, torchrun's ranks, kills)."""
    return subprocess.run([sys.executable, "-m", "flexgen_h2o.run", *args], env=env, cwd=cwd or REPO,
                          capture_output=True, text=True, timeout=timeout, **kw)


class Ran(NamedTuple):
    """What run_main saw: run_cli's CompletedProcess fields that the tests read."""
    returncode: int
    stdout: str
    stderr: str


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """os.environ is `env` inside (what a subprocess given env= would see), as it was before afterwards."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run_main(args: list[str], env: dict[str, str], cwd: Path | None = None,
             main: Callable[[list[str]], int] | None = None, merged: bool = False) -> Ran:
    """run_cli in this process: `main(args)` (default flexgen_h2o.run.main) under `env` and in `cwd` (default the
    repository, as run_cli), its stdout and stderr captured and its exit status returned as a subprocess's would
    be (argparse's refusals exit from the parser). merged: stderr into stdout, one stream in the order printed.
    The environment and the working folder are restored after."""
    out = io.StringIO()
    err = out if merged else io.StringIO()
    here = os.getcwd()
    with environment(env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        if main is None:          # imported here: run.py sets environment defaults when first imported
            from flexgen_h2o.run import main
        os.chdir(cwd or REPO)
        try:
            code = main(args)
        except SystemExit as e:                  # as the interpreter ends: an int is the status, text goes to stderr
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            os.chdir(here)
    return Ran(code, out.getvalue(), "" if merged else err.getvalue())


def kill_once_written(args: list[str], out: Path, env: dict[str, str], log: Path, lines: int) -> int:
    """Run `python -m flexgen_h2o.run args`, SIGKILL it as soon as `out` holds `lines` whole lines (or after 240 s);
    its output goes to `log`. Returns its exit status (-SIGKILL when it was killed)."""
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "flexgen_h2o.run", *args], env=env, cwd=REPO, stdout=f,
                                stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= lines:
                break
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        return proc.wait(30)


# Runs the CLI with ResultsFile.append wrapped: the append that would bring this run's file to `lines` lines SIGKILLs
# the process, before its write (that block's answers are lost and must be recomputed) or after it (fsync'd).
# A kill point in lines, not in time, so a job that bursts its held answers out at once cannot finish first.
_KILL_AT_LINE = """
import os, runpy, signal, sys
from flexgen_h2o.frontends import jsonl
target, before = int(sys.argv[1]), sys.argv[2] == "before"
plain = jsonl.ResultsFile.append
def append(self, records):
    recs = list(records)
    have = self.path.read_bytes().count(b"\\n") if self.path.exists() else 0
    if have + len(recs) >= target and before:
        os.kill(os.getpid(), signal.SIGKILL)
    plain(self, recs)
    if have + len(recs) >= target:
        os.kill(os.getpid(), signal.SIGKILL)
jsonl.ResultsFile.append = append
sys.argv = ["flexgen_h2o.run", *sys.argv[3:]]
runpy.run_module("flexgen_h2o.run", run_name="__main__")
"""


def kill_at_line(args: list[str], env: dict[str, str], log: Path, lines: int, before: bool) -> int:
    """Run `python -m flexgen_h2o.run args`, SIGKILLed by itself at the append that brings the output to `lines`
    lines (before or after that write). Returns its exit status (-SIGKILL when it was killed)."""
    with open(log, "w") as f:
        return subprocess.run([sys.executable, "-c", _KILL_AT_LINE, str(lines), "before" if before else "after",
                               *args], env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=300).returncode


def tokens_by_id(path: Path) -> dict:
    """A batch job's output file: id -> generated token ids."""
    return {r["id"]: r["token_ids"] for r in map(json.loads, path.read_text().splitlines())}


def own_home(env: dict[str, str], root: Path) -> dict[str, str]:
    """`env` with its own $FLEXGEN_H2O_HOME under `root`, a copy of env's (the converted stores): for a test that
    writes into the home, such as the cost model's cached rates, which every later run there would then use."""
    home = root / "own-home"
    shutil.copytree(env["FLEXGEN_H2O_HOME"], home, symlinks=True)
    return dict(env, FLEXGEN_H2O_HOME=str(home))
