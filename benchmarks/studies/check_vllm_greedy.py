"""Does vLLM (the `vllm` peer's own venv) generate the same greedy tokens as HF transformers on the same weights?

Both read the HF folder of our SmolLM2 store (benchmarks/model_formats.py, fp32). Prompts: the two strings of
transformers' SmolLM2 cache test (ANCHORS §8.4) and two Lee news windows of the suite's benchmark prompts (the
same ids the suite feeds every system). HF side: a plain argmax loop over full forwards (no cache, no stopping at
EOS), which is what greedy with vLLM's `ignore_eos` means. vLLM side: `vllm_child.py --greedy-ids`, all prompts in
one batch. Exit 0 when every prompt's tokens match, 1 otherwise.

    python -m benchmarks.studies.check_vllm_greedy [--gen-len 16] [--lee-len 64] [--inproc] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.studies.check_formats import TEXT_PROMPTS, hf_greedy   # one reference for both checks


def prompt_ids(folder: Path, lee_len: int) -> list[list[int]]:
    """The text prompts (HF tokenizer of the folder) and two Lee windows of `lee_len` tokens (the suite's ids)."""
    from transformers import AutoTokenizer

    from flexgen_h2o.frontends.corpus import benchmark_prompts
    from flexgen_h2o.loader import load_tokenizer
    from flexgen_h2o.weights import default_store_path
    tok = AutoTokenizer.from_pretrained(str(folder))
    texts = [tok(t)["input_ids"] for t in TEXT_PROMPTS]
    store_tok = load_tokenizer(default_store_path("smollm2-135m"))
    return texts + benchmark_prompts(store_tok, 2, lee_len, tok.vocab_size)


def vllm_greedy(folder: Path, prompts: list[list[int]], gen_len: int, work: Path,
                inproc: bool = False) -> list[list[int]]:
    from benchmarks.common import REPO_ROOT, bench_env
    from benchmarks.systems import vllm
    reason = vllm.ensure_venv(log=work / "vllm_venv.log")
    if reason:
        raise SystemExit(f"error: {reason}")
    ids, out = work / "greedy_prompts.json", work / "greedy_vllm.json"
    ids.write_text(json.dumps(prompts))
    cmd = [str(vllm.venv_python()), str(vllm.CHILD), "--model", str(folder), "--ids", str(ids),
           "--gen-len", str(gen_len), "--greedy-ids", "--json", str(out)] + (["--inproc"] if inproc else [])
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=bench_env(), capture_output=True, text=True)
    (work / "greedy_vllm.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not out.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        raise SystemExit(f"error: the vllm child failed (exit {proc.returncode}):\n{tail}")
    return json.loads(out.read_text())["ids"]


def compare(hf: list[list[int]], vl: list[list[int]]) -> list[dict[str, Any]]:
    """Per prompt: equal or not, and the first position where they differ (None when equal)."""
    rows = []
    for a, b in zip(hf, vl, strict=True):
        diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if diff is None and len(a) != len(b):
            diff = min(len(a), len(b))
        rows.append({"equal": diff is None, "first_diff": diff, "hf": a, "vllm": b})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gen-len", type=int, default=16)
    p.add_argument("--lee-len", type=int, default=64, help="tokens of each Lee news prompt")
    p.add_argument("--inproc", action="store_true", help="vLLM's engine in one process (the vllm-inproc system)")
    p.add_argument("--json", type=Path, help="write the comparison here")
    a = p.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from transformers import AutoTokenizer

    from benchmarks.model_formats import hf_folder
    folder = hf_folder()
    prompts = prompt_ids(folder, a.lee_len)
    with tempfile.TemporaryDirectory() as tmp:
        vl = vllm_greedy(folder, prompts, a.gen_len, Path(tmp), a.inproc)
    rows = compare(hf_greedy(folder, prompts, a.gen_len), vl)
    tok = AutoTokenizer.from_pretrained(str(folder))
    names = [repr(t) for t in TEXT_PROMPTS] + [f"Lee window {i} ({a.lee_len} tokens)" for i in (1, 2)]
    for name, r in zip(names, rows):
        verdict = "equal" if r["equal"] else f"DIFFER from token {r['first_diff']}"
        print(f"{name}: {verdict}; HF {tok.decode(r['hf'])!r}" + ("" if r["equal"] else
                                                                 f" vs vLLM {tok.decode(r['vllm'])!r}"))
    if a.json:
        a.json.write_text(json.dumps({"gen_len": a.gen_len, "prompts": names, "results": rows}, indent=2))
    ok = all(r["equal"] for r in rows)
    print(f"{sum(r['equal'] for r in rows)}/{len(rows)} prompts equal", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
