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

With --target-size N (decoding mode) the press is kvpress's PrefillDecodingPress: the scorer press compresses the
prompt to exactly N tokens per KV head at prefill, and a DecodingPress around a second instance of the same scorer
stays hooked during decoding, evicting back down to N every --compression-interval steps, so the cache is
bounded. The JSON then also says how long the decoding press's hook took (`decode_press_s`, scoring + eviction
inside decode_s) and the largest cache it saw after any step (`kv_tokens_max_decode`).

    <venv>/bin/python benchmarks/systems/kvpress_child.py --store ... --ids ... --batch 8 --gen-len 32 \
        --press ObservedAttentionPress --target-size 102 --compression-interval 1 --json F
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
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


def prefill_ratio(prompt_len: int, target: int) -> float:
    """The compression_ratio that makes kvpress keep exactly `target` of `prompt_len` tokens: it keeps
    int(prompt_len * (1 - ratio)), and aiming half a token above the target survives float rounding."""
    return max(0.0, 1 - (target + 0.5) / prompt_len)


def build_press(a: argparse.Namespace, prompt_len: int, target: int | None) -> tuple[Any, Any]:
    """(the press held over the run, its DecodingPress or None). Prefill-only without a target."""
    import kvpress
    scorer = getattr(kvpress, a.press)
    if target is None:
        return scorer(compression_ratio=a.compression_ratio), None
    # the decoding scorer gets no ratio of its own: DecodingPress sets one per compression to reach target_size
    dec = kvpress.DecodingPress(base_press=scorer(), compression_interval=a.compression_interval,
                                target_size=target, hidden_states_buffer_size=a.hidden_states_buffer_size)
    pre = scorer(compression_ratio=prefill_ratio(prompt_len, target))
    return kvpress.PrefillDecodingPress(prefilling_press=pre, decoding_press=dec), dec


def press_config(a: argparse.Namespace, prompt_len: int) -> dict[str, Any]:
    if a.target_size is None:
        return {"mode": "prefill", "press": a.press, "compression_ratio": a.compression_ratio}
    return {"mode": "prefill+decoding", "wrapper": "PrefillDecodingPress",
            "prefilling_press": {"class": a.press, "compression_ratio": prefill_ratio(prompt_len, a.target_size)},
            "decoding_press": {"class": "DecodingPress", "base_press": a.press, "target_size": a.target_size,
                               "compression_interval": a.compression_interval,
                               "hidden_states_buffer_size": a.hidden_states_buffer_size}}


def timed_hook(dec: Any, acc: list[float]) -> None:
    """Time the DecodingPress's forward hook (scoring + eviction). BasePress.__call__ registers the instance's
    attribute, and PrefillDecodingPress calls decoding_press.forward_hook, so an instance attribute wraps both."""
    hook = type(dec).forward_hook.__get__(dec)

    def wrapped(*args: Any) -> Any:
        t = time.perf_counter()
        try:
            return hook(*args)
        finally:
            acc[0] += time.perf_counter() - t
    dec.forward_hook = wrapped


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
    decoding = a.target_size is not None
    rss_prefill = [0]                   # the peak when prefill ends: tells a prefill peak from a decode one

    def generate(x: Any, n: int, target: int | None) -> tuple[float, list[float], Any, list[float], int]:
        press, dec = build_press(a, x.shape[1], target)
        hook_s = [0.0]
        if dec is not None:
            timed_hook(dec, hook_s)
        cache = DynamicCache()
        b, p = x.shape
        seen = 0
        with torch.inference_mode(), contextlib.ExitStack() as held:
            t0 = time.perf_counter()
            held.enter_context(press(model))
            out = model(input_ids=x, past_key_values=cache, logits_to_keep=1)
            if not decoding:
                held.close()            # prefill-only: decode outside the press
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            stamps = [time.perf_counter()]
            rss_prefill[0] = peak_rss_bytes()
            pos = torch.full((b, 1), p, dtype=torch.long)
            for i in range(n - 1):
                out = model(input_ids=tok, past_key_values=cache, position_ids=pos + i)
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
                stamps.append(time.perf_counter())
                seen = max(seen, max(layer.keys.shape[2] for layer in cache.layers))
        return t0, stamps, cache, hook_s, seen

    if a.warmup:                        # a short run through the same code, the target scaled to 32 tokens
        generate(ids[:, :32], 2, None if not decoding else max(1, a.target_size * 32 // ids.shape[1]))
    t0, s, cache, hook_s, seen = generate(ids, a.gen_len, a.target_size)
    layers = cache.layers
    kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in layers)
    per_layer = [int(layer.keys.shape[2]) for layer in layers]
    out = {"batch": a.batch, "prompt_len": ids.shape[1], "gen_len": len(s), "prefill_s": s[0] - t0,
           "decode_s": s[-1] - s[0], "step_times_s": [y - x for x, y in zip(s, s[1:])],
           "peak_rss_bytes": peak_rss_bytes(), "peak_rss_prefill_bytes": rss_prefill[0],
           "kv_bytes_per_seq": kv / a.batch,
           "kv_tokens_per_seq": per_layer[0], "kv_tokens_range": [min(per_layer), max(per_layer)],
           "press": a.press, "compression_ratio": a.compression_ratio if not decoding else None,
           "press_config": press_config(a, ids.shape[1]),
           "attn_implementation": model.config._attn_implementation,
           "threads": torch.get_num_threads(), "transformers_version": transformers.__version__,
           "kvpress_version": getattr(kvpress, "__version__", None) or _dist_version("kvpress")}
    if decoding:
        out.update(target_size=a.target_size, decode_press_s=hook_s[0], kv_tokens_max_decode=seen)
    return out


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--store", required=True)
    p.add_argument("--ids", required=True, help="JSON list of prompts (token id lists of one length)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--gen-len", type=int, default=8)
    p.add_argument("--press", default="ObservedAttentionPress")
    p.add_argument("--compression-ratio", type=float, default=0.8, help="prefill-only mode's ratio")
    p.add_argument("--target-size", type=int, default=None,
                   help="decoding mode: tokens per KV head kept from prefill through every decode step")
    p.add_argument("--compression-interval", type=int, default=1, help="decoding mode: evict every N steps")
    p.add_argument("--hidden-states-buffer-size", type=int, default=0,
                   help="decoding mode: hidden states DecodingPress buffers for its scorer (0: none)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", required=True)
    return p


def main() -> int:
    a = make_parser().parse_args()
    if a.target_size is not None and (a.target_size < 1 or a.compression_interval < 1):
        raise SystemExit("error: --target-size and --compression-interval must be >= 1")
    Path(a.json).write_text(json.dumps(run(a), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
