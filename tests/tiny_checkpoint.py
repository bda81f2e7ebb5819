"""A tiny local HF checkpoint (random Llama, GQA) with a character-level tokenizer, for CLI and API tests.

The CLI takes a local folder as --model and converts it into a store under $FLEXGEN_H2O_HOME, tokenizer
included, so subprocess tests run the real entry point offline in a few seconds. Every printable ASCII
character is one token, which makes prompt lengths exact and easy to choose.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import VOCAB, tiny_hf

REPO = Path(__file__).resolve().parents[1]
SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")


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
    return subprocess.run([sys.executable, "-m", "flexgen_h2o.run", *args], env=env, cwd=cwd or REPO,
                          capture_output=True, text=True, timeout=timeout, **kw)


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
