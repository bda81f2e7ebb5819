"""One kvpress case, run by the kvpress virtualenv's interpreter (transformers < 5.3): never imports flexgen_h2o
or benchmarks, which need the main environment.

    <venv>/bin/python benchmarks/systems/kvpress_child.py --store ~/.cache/flexgen_h2o/smollm2-135m \
        --ids prompt_ids.json --batch 2 --gen-len 8 --press ObservedAttentionPress --compression-ratio 0.8 --json F

The model is SmolLM2 as a LlamaForCausalLM built from our converted store (fp16 .npy + manifest), in fp32 (the
engine's CPU compute dtype). The loop is kvpress's own pipeline (`KVPressTextGenerationPipeline._forward` and
`generate_answer`), batched: prefill under the press (which compresses each layer's cache right after that
layer's attention), then greedy decoding outside it with explicit true positions, so the shortened cache keeps
RoPE positions right. Prefill here includes the LM head on the last position (the first generated token), as
FlexGen's and our prefill do. ObservedAttentionPress needs eager attention (it reads the attention weights);
StreamingLLMPress runs on transformers' default (sdpa).
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

# run as a script, this folder is sys.path[0], and its kvpress.py (the adapter) would shadow the kvpress package
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]


def peak_rss_bytes() -> int:
    """VmHWM, as flexgen_h2o.metrics reads it for every other system."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def load_model(store: Path, attn: str) -> Any:
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    man = json.loads((store / "manifest.json").read_text())
    c = man["config"]
    cfg = LlamaConfig(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_hidden_layers=c["n_layers"],
                      intermediate_size=c["ffn_size"], num_attention_heads=c["n_heads"],
                      num_key_value_heads=c["n_kv_heads"], head_dim=c["head_dim"],
                      max_position_embeddings=c["max_seq_len"], rms_norm_eps=c["norm_eps"],
                      tie_word_embeddings=c["tie_word_embeddings"],
                      rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"]},
                      bos_token_id=c["bos_id"], eos_token_id=c["eos_id"], pad_token_id=c["pad_id"],
                      attn_implementation=attn)
    model = LlamaForCausalLM(cfg)
    files = {name: t["file"] for name, t in man["tensors"].items()}
    with torch.no_grad():           # one tensor at a time: a whole state dict would double the loading peak RSS
        for name, param in model.named_parameters():      # the tied lm_head is the embedding parameter
            param.copy_(torch.from_numpy(np.load(store / files[name.removeprefix("model.")])))
    return model.eval()


def run(a: argparse.Namespace) -> dict[str, Any]:
    import kvpress
    import torch
    import transformers
    from transformers import DynamicCache

    attn = "eager" if a.press == "ObservedAttentionPress" else "sdpa"
    model = load_model(Path(a.store), attn)
    ids_all = json.loads(Path(a.ids).read_text())
    if len(ids_all) < a.batch:
        raise SystemExit(f"error: {a.ids} holds {len(ids_all)} prompts, batch {a.batch} asked")
    ids = torch.tensor(ids_all[:a.batch], dtype=torch.long)
    press = getattr(kvpress, a.press)(compression_ratio=a.compression_ratio)

    def generate(x: Any, n: int) -> tuple[float, list[float], Any]:
        cache = DynamicCache()
        b, p = x.shape
        with torch.inference_mode():
            t0 = time.perf_counter()
            with press(model):
                out = model(input_ids=x, past_key_values=cache, logits_to_keep=1)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            stamps = [time.perf_counter()]
            pos = torch.full((b, 1), p, dtype=torch.long)
            for i in range(n - 1):
                out = model(input_ids=tok, past_key_values=cache, position_ids=pos + i)
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
                stamps.append(time.perf_counter())
        return t0, stamps, cache

    if a.warmup:
        generate(ids[:, :32], 2)
    t0, s, cache = generate(ids, a.gen_len)
    layers = cache.layers
    kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in layers)
    return {"batch": a.batch, "prompt_len": ids.shape[1], "gen_len": len(s), "prefill_s": s[0] - t0,
            "decode_s": s[-1] - s[0], "step_times_s": [y - x for x, y in zip(s, s[1:])],
            "peak_rss_bytes": peak_rss_bytes(), "kv_bytes_per_seq": kv / a.batch,
            "kv_tokens_per_seq": int(layers[0].keys.shape[2]), "press": a.press,
            "compression_ratio": a.compression_ratio, "attn_implementation": model.config._attn_implementation,
            "threads": torch.get_num_threads(), "transformers_version": transformers.__version__,
            "kvpress_version": getattr(kvpress, "__version__", None) or _dist_version("kvpress")}


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--store", required=True)
    p.add_argument("--ids", required=True, help="JSON list of prompts (token id lists of one length)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--gen-len", type=int, default=8)
    p.add_argument("--press", default="ObservedAttentionPress")
    p.add_argument("--compression-ratio", type=float, default=0.8)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", required=True)
    a = p.parse_args()
    Path(a.json).write_text(json.dumps(run(a), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
