"""KV quantization's group dimension: per-token keys, per-channel keys (KIVI) and the engine's scaled per-token keys.

The engine's cache groups keys and values per token: each cache slot's head_dim values are one group, so a slot is
self-contained and H2O can write or evict it in place (keys divided by a per-channel scale first: the token-scaled
scheme below). KIVI (Liu et al., 2024) quantizes keys per channel (one group = one channel over consecutive
tokens), because key outliers sit in fixed channels, and values per token. A per-channel group spans `group` slots,
so in the engine it would have to be re-quantized whenever one of its slots is evicted or written. This study
measures what per-channel keys buy and how much of it the per-channel scale keeps, outside the engine: SmolLM2's
weights in transformers' LlamaForCausalLM, with an attention function that replaces every layer's keys and values
(after RoPE, as the engine caches them) by their quantize -> dequantize round trip before a plain causal softmax
attention in fp32. Schemes:

- fp16: keys and values rounded to fp16 (the engine's default cache);
- token: keys and values in groups along head_dim (quant.GroupQuant(bits, group, dim=-1)), the engine's first format;
- channel: keys per channel over groups of `group` consecutive tokens (GroupQuant(bits, group, dim=2) on
  (b, kv_heads, L, d)), values per token;
- token-scaled: the engine's compressed cache since 2026-11-28: keys divided by each channel's largest |k| (here
  over the window; the engine takes it over the prompt), grouped per token, multiplied back; values per token.

Every token's K/V is rounded, each query's own included (KIVI keeps the newest < group tokens in full precision;
here nothing is). A per-channel group's range also covers up to group - 1 tokens after a query (a causal cache
could not have quantized that group yet); that leaks no token, only a range. Loss is taken on every token of a
window but the first `skip`, in one full forward per window.

    python -m benchmarks.studies.kv_group_dim --out benchmarks/results/quant-quality
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")     # before torch loads OpenMP

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor  # noqa: E402

from benchmarks.systems.hf_generate import load_smollm2  # noqa: E402

ATTN_NAME = "kv_group_dim_rounded"
SCHEMES = ("fp16", "token", "channel", "token-scaled")
CURRENT: dict[str, Any] = {"scheme": None, "bits": 8, "group": 64}    # what the attention function rounds by


def round_trip(x: Tensor, bits: int, group: int, dim: int) -> Tensor:
    from flexgen_h2o.quant import GroupQuant
    quant = GroupQuant(bits, group, dim=dim)
    return quant.unpack(quant.pack(x), x.dtype)


def stored_kv(scheme: str | None, bits: int, group: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    """key, value (b, kv_heads, L, d) as a cache of this scheme would give them back."""
    if scheme is None:                                           # the self-check: no rounding at all
        return key, value
    if scheme == "fp16":
        return key.half().to(key.dtype), value.half().to(value.dtype)
    value = round_trip(value, bits, group, -1)
    if scheme == "token-scaled":
        scale = key.abs().amax(dim=2, keepdim=True).clamp(min=1e-30)       # (b, g, 1, d): per channel
        return round_trip(key / scale, bits, group, -1) * scale, value
    return round_trip(key, bits, group, -1 if scheme == "token" else 2), value


def rounded_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs: Any) -> tuple[Tensor, None]:
    """query (b, h, q, d); key, value (b, g, L, d). One unpadded sequence per row, so the mask is plain causal."""
    key, value = stored_kv(CURRENT["scheme"], CURRENT["bits"], CURRENT["group"], key, value)
    r = query.shape[1] // key.shape[1]                           # query head i reads KV head i // r (repeat_kv)
    k, v = (x.repeat_interleave(r, dim=1).float() for x in (key, value))
    out = F.scaled_dot_product_attention(query.float(), k, v, is_causal=True, scale=scaling)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def smollm2_hf() -> tuple[torch.nn.Module, Any]:
    """SmolLM2's converted weights in transformers' LlamaForCausalLM (fp32), every layer's attention ours."""
    from transformers import AttentionInterface
    model, tok = load_smollm2("cpu", torch.float32)
    AttentionInterface.register(ATTN_NAME, rounded_attention)
    return model, tok


@torch.no_grad()
def window_nll(model: torch.nn.Module, ids: Tensor, skip: int, chunk: int = 256) -> Tensor:
    """Per window (rows of ids), the mean NLL (nats) of tokens skip.. given everything before them; the head
    runs on `chunk` positions at a time so that no (rows, L, vocab) logits tensor is ever whole."""
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[:, skip - 1:-1]
    targets = ids[:, skip:]
    total = torch.zeros(ids.shape[0], dtype=torch.float64)
    for lo in range(0, targets.shape[1], chunk):
        logits = model.lm_head(hidden[:, lo:lo + chunk]).float()
        nll = F.cross_entropy(logits.transpose(1, 2), targets[:, lo:lo + chunk], reduction="none")
        total += nll.sum(1).double()
    return total / targets.shape[1]


def corpus_windows(tok: Any, corpus: str, n: int, length: int, skip: int) -> Tensor:
    from flexgen_h2o.eval.data import perplexity_items
    return torch.tensor([a + b for a, b in perplexity_items(tok, corpus, n, skip, length - skip)])


def run_scheme(model: torch.nn.Module, windows: Tensor, skip: int, batch: int) -> list[float]:
    return [x for lo in range(0, len(windows), batch) for x in window_nll(model, windows[lo:lo + batch], skip).tolist()]


def self_check(model: torch.nn.Module, ids: Tensor) -> float:
    """Largest |logit| difference between transformers' own attention and ours without rounding (should be
    fp32 noise): our function is the attention the schemes change, and nothing else."""
    with torch.no_grad():
        model.config._attn_implementation = "sdpa"
        ref = model(input_ids=ids, use_cache=False).logits
        model.config._attn_implementation = ATTN_NAME
        CURRENT["scheme"] = None
        ours = model(input_ids=ids, use_cache=False).logits
    return float((ref - ours).abs().max())


def markdown(result: dict) -> str:
    corpora = list(result["windows"])
    head = "| scheme | bits | " + " | ".join(f"{c} ppl | {c} / fp16" for c in corpora) + " |\n"
    lines = [head, "|---|---|" + "---|---|" * len(corpora) + "\n"]
    for row in result["rows"]:
        cells = " | ".join(f"{row[c]['ppl']:.3f} | {row[c]['ppl'] / result['rows'][0][c]['ppl']:.4f}" for c in corpora)
        lines.append(f"| {row['scheme']} | {row['bits'] or '-'} | {cells} |\n")
    return "".join(lines)


def paired(rows: list[dict], corpus: str, a: str, b: str, bits: int) -> dict:
    """Mean and standard error over windows of the per-window NLL difference a - b (the same windows on both
    sides, so the text's own variation cancels)."""
    get = {(r["scheme"], r["bits"]): r[corpus]["window_nll"] for r in rows}
    d = [x - y for x, y in zip(get[(a, bits)], get[(b, bits)])]
    mean = sum(d) / len(d)
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d)) if len(d) > 1 else float("nan")
    return {"nll_diff_mean": mean, "nll_diff_stderr": se}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.kv_group_dim", description=__doc__.split("\n\n")[0])
    p.add_argument("--lee-windows", type=int, default=4, help="4 + 4 windows x 5 cases: ~3 min on 2 cores")
    p.add_argument("--wiki-windows", type=int, default=4)
    p.add_argument("--length", type=int, default=1024, help="tokens per window")
    p.add_argument("--skip", type=int, default=64, help="first tokens of each window not scored")
    p.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    p.add_argument("--group", type=int, default=64, help="values per group (head_dim; tokens for channel keys)")
    p.add_argument("--batch", type=int, default=4, help="windows per forward")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/quant-quality"))
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    model, tok = smollm2_hf()
    windows = {c: corpus_windows(tok, c, n, a.length, a.skip)
               for c, n in (("lee", a.lee_windows), ("wiki", a.wiki_windows)) if n > 0}
    check = self_check(model, next(iter(windows.values()))[:1, :128])
    print(f"self-check: max |logit| ours (no rounding) vs transformers' sdpa: {check:.2e}")
    CURRENT["group"] = a.group
    rows = []
    for scheme, bits in [("fp16", None)] + [(s, b) for b in a.bits for s in SCHEMES[1:]]:
        CURRENT.update(scheme=scheme, bits=bits)
        row: dict[str, Any] = {"scheme": scheme, "bits": bits}
        for corpus, ids in windows.items():
            nll = run_scheme(model, ids, a.skip, a.batch)
            row[corpus] = {"ppl": math.exp(sum(nll) / len(nll)), "window_nll": nll}
        rows.append(row)
        print(f"{scheme} {bits or ''}: " + ", ".join(f"{c} ppl {row[c]['ppl']:.3f}" for c in windows)
              + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    result = {"command": shlex.join(["python", "-m", "benchmarks.studies.kv_group_dim", *(argv or sys.argv[1:])]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "args": {k: str(v) for k, v in vars(a).items()}, "model": "smollm2-135m (SmolLM2-135M-Instruct)",
              "windows": {c: len(ids) for c, ids in windows.items()}, "scored_tokens_per_window": a.length - a.skip,
              "self_check_max_logit_diff": check, "rows": rows,
              "channel_minus_token": {c: {b: paired(rows, c, "channel", "token", b) for b in a.bits} for c in windows},
              "seconds": time.perf_counter() - t0}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "kv_group_dim.json").write_text(json.dumps(result, indent=2))
    print("\n" + markdown(result))
    for c, per_bits in result["channel_minus_token"].items():
        for b, d in per_bits.items():
            print(f"{c} int{b}: NLL(channel) - NLL(token) = {d['nll_diff_mean']:+.4f} +- {d['nll_diff_stderr']:.4f} "
                  f"nats/token (mean +- s.e. over windows)")
    print("all tokens' K/V rounded, each query's own included; keys rounded after RoPE")
    print(f"wrote {a.out / 'kv_group_dim.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
