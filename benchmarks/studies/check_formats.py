"""Checks that the peers' model formats hold the same model: greedy token ids from the HF folder (transformers, the
main environment) against the OpenVINO IR exported from it (benchmarks/systems/openvino_child.py in its venv), on
a few short prompts, 16 new tokens each.

Prompts: transformers' own SmolLM2 cache-test prompts ("A sequence: 1, 2, 3, 4, 5", "A sequence: A, B, C"; ANCHORS
§8.4) and two 128-token windows of the Lee news text the benchmarks use. HF's side is a plain greedy loop (argmax
of a full forward pass per token, fp32, no cache, EOS not special), so nothing in `generate`'s configuration can
differ. OpenVINO runs each KV precision (f16, u8) with the plugin's default compute precision (bf16 on a CPU with
AVX512_BF16) and with f32 forced. A row matches when all 16 ids are equal; `prefix` counts the leading equal ids
(a quantized cache or bf16 compute may legitimately flip a near-tie late).

    python -m benchmarks.studies.check_formats [--gen-len 16] [--json check_formats.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

TEXT_PROMPTS = ["A sequence: 1, 2, 3, 4, 5", "A sequence: A, B, C"]
NEWS_PROMPTS, NEWS_LEN = 2, 128
# (KV precision, compute precision hint; None = the plugin's default)
OV_CONFIGS = [("f16", None), ("u8", None), ("f16", "f32"), ("u8", "f32")]


def prompts(tok: Any, vocab_size: int) -> list[list[int]]:
    from flexgen_h2o.frontends.corpus import benchmark_prompts
    ids = [tok.encode(t, add_special_tokens=False) for t in TEXT_PROMPTS]
    return ids + benchmark_prompts(tok, NEWS_PROMPTS, NEWS_LEN, vocab_size)


def hf_greedy(hf_dir: Path, batch: list[list[int]], n: int) -> list[list[int]]:
    """n argmax tokens per prompt, one full forward pass per token (the reference: no cache, no padding)."""
    import torch
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in batch:
            ids = torch.tensor([p])
            for _ in range(n):
                nxt = model(input_ids=ids).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            out.append(ids[0, len(p):].tolist())
    return out


def ov_greedy(ir: Path, batch: list[list[int]], n: int, kv: str, hint: str | None, work: Path) -> dict[str, Any]:
    from benchmarks.common import bench_env
    from benchmarks.systems import openvino as ovs
    src, res = work / "prompts.json", work / f"ov_{kv}_{hint or 'default'}.json"
    src.write_text(json.dumps(batch))
    cmd = [str(ovs.venv_python()), str(ovs.CHILD), "--ir", str(ir), "--check-greedy", str(src), "--gen-len", str(n),
           "--kv-precision", kv, "--json", str(res)] + (["--inference-precision", hint] if hint else [])
    proc = subprocess.run(cmd, env=bench_env(2), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: the OpenVINO child failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return json.loads(res.read_text())


def prefix(a: list[int], b: list[int]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--gen-len", type=int, default=16)
    p.add_argument("--json", type=Path, default=Path(tempfile.gettempdir()) / "check_formats.json")
    a = p.parse_args()
    from transformers import AutoTokenizer

    from benchmarks.model_formats import hf_folder
    from benchmarks.systems import openvino as ovs
    from flexgen_h2o.models import resolve_model
    reason = ovs.ensure_venv()
    ir, reason = (None, reason) if reason else ovs.export_ir(a.model)
    if reason:
        raise SystemExit(f"error: {reason}")
    hf = hf_folder(a.model)
    tok = AutoTokenizer.from_pretrained(str(hf))
    batch = prompts(tok, resolve_model(a.model).vocab_size)
    ref = hf_greedy(hf, batch, a.gen_len)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kv, hint in OV_CONFIGS:
            got = ov_greedy(ir, batch, a.gen_len, kv, hint, Path(tmp))
            for i, (r, g) in enumerate(zip(ref, got["tokens"])):
                rows.append({"prompt": i, "kv_precision": kv, "inference_precision": got["inference_precision"],
                             "match": r == g, "prefix": prefix(r, g), "hf": r, "openvino": g,
                             "hf_text": tok.decode(r), "openvino_text": tok.decode(g)})
    print(f"{'prompt':>6} {'KV':>4} {'compute':>7} {'match':>5} {'prefix':>6}  HF text | OpenVINO's (if it differs)")
    for r in rows:
        diff = "" if r["match"] else f" | {r['openvino_text']!r}"
        print(f"{r['prompt']:>6} {r['kv_precision']:>4} {r['inference_precision']:>7} {str(r['match']):>5} "
              f"{r['prefix']:>4}/{a.gen_len}  {r['hf_text']!r}{diff}")
    a.json.write_text(json.dumps({"model": a.model, "gen_len": a.gen_len, "prompts": batch, "hf": ref,
                                  "rows": rows}, indent=2))
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
