"""The accuracy grid's kvpress rows: prompts run under one kvpress press, one at a time, by the kvpress virtualenv's
interpreter (transformers < 5.3); never imports flexgen_h2o or benchmarks, which need the main environment.

    <venv>/bin/python benchmarks/systems/kvpress_eval_child.py --input IN.json --json OUT.json

IN.json: {"store": folder, "press": snapkv|tova|adakv|observed, "params": {...} (optional, PRESSES' defaults),
"eos_id": int | null, "items": [{"prompt": [ids], "forced": [ids] | null, "max_new": int, "keep": int}]}.

The model is SmolLM2 (or another Llama-family store) as a LlamaForCausalLM built in fp32 by kvpress_child.load_model.
Each item runs at batch 1 (no padding), as kvpress's pipeline runs: prefill under the press with
compression_ratio = 1 - keep / len(prompt), so the press keeps exactly `keep` prompt tokens per KV head (checked
after the prefill), then greedy steps outside the press with explicit true positions. The press compresses at
prefill only: the cache then grows by one token per step. Unlike kvpress's pipeline, the whole prompt is
compressed (the pipeline compresses a context and prefills the question after it, uncompressed), so a row keeps
what our policies keep: `keep` tokens of the whole prompt.

- forced null: greedy generation, up to max_new tokens, stopping after eos_id; out: "generated".
- forced ids: teacher-forced after the compressed prompt; step t's logits (fp32 log-softmax, natural log) score
  forced[t]; out: "nll" and "hit" (argmax == forced[t]).

Each finished item is also printed to stdout as one line `item <json>` (after a `meta <json>` line), so the
caller can checkpoint while the run goes on; OUT.json holds the meta and every item at the end.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

# run as a script, this folder is sys.path[0], and its kvpress.py (the adapter) would shadow the kvpress package
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

# press -> (kvpress class, default parameters, attention implementation). AdaKV wraps a SnapKV with these
# parameters and refuses eager; ObservedAttention reads the attention weights, which only eager returns.
PRESSES: dict[str, tuple[str, dict[str, Any], str]] = {
    "snapkv": ("SnapKVPress", {"window_size": 64, "kernel_size": 5}, "sdpa"),
    "tova": ("TOVAPress", {}, "sdpa"),
    "adakv": ("AdaKVPress", {"window_size": 64, "kernel_size": 5, "alpha_safeguard": 0.20}, "sdpa"),
    "observed": ("ObservedAttentionPress", {}, "eager"),
}
COMPRESSION = "prefill-only: the press compresses the prompt once; the cache then grows by one token per step"


class InputError(ValueError):
    """Bad input JSON: one `error:` line, exit 2."""


def n_kept(length: int, ratio: float) -> int:
    """kvpress 0.5.5's compute_n_kept, the rule every press of the rows applies to the prompt's length."""
    return 0 if ratio >= 1.0 else max(1, int(length * (1 - ratio)))


def ratio_for(keep: int, length: int) -> float:
    """compression_ratio = 1 - keep / length, nudged where floating point makes int(length * (1 - ratio)) miss
    keep: for 40 of 200, 1 - 40 / 200 = 0.8 and 200 * (1 - 0.8) = 39.99999999999999, which kvpress truncates to 39."""
    if not 1 <= keep <= length:
        raise InputError(f"keep {keep} must be in 1..{length} (the prompt's length)")
    ratio = 1.0 - keep / length
    for _ in range(8):
        if int(length * (1 - ratio)) == keep:
            break
        ratio -= 1e-12 if int(length * (1 - ratio)) < keep else -1e-12
    assert int(length * (1 - ratio)) == keep and n_kept(length, ratio) == keep and 0.0 <= ratio < 1.0, (keep, length)
    return ratio


def press_params(press: str, given: dict[str, Any] | None) -> dict[str, Any]:
    if press not in PRESSES:
        raise InputError(f"unknown press {press!r}; choose from {', '.join(PRESSES)}")
    defaults = PRESSES[press][1]
    bad = sorted(set(given or {}) - set(defaults))
    if bad:
        raise InputError(f"{press} takes no parameter {', '.join(bad)} (it takes {', '.join(defaults) or 'none'})")
    return {**defaults, **(given or {})}


def make_press(press: str, params: dict[str, Any], ratio: float) -> Any:
    import kvpress
    if press == "adakv":
        inner = kvpress.SnapKVPress(compression_ratio=ratio, window_size=params["window_size"],
                                    kernel_size=params["kernel_size"])
        return kvpress.AdaKVPress(press=inner, alpha_safeguard=params["alpha_safeguard"])
    return getattr(kvpress, PRESSES[press][0])(compression_ratio=ratio, **params)


def check_items(items: Any, press: str, params: dict[str, Any]) -> None:
    if not isinstance(items, list) or not items:
        raise InputError("items must be a non-empty list")
    for i, it in enumerate(items):
        if not isinstance(it, dict) or not {"prompt", "forced", "max_new", "keep"} <= set(it):
            raise InputError(f"item {i} needs prompt, forced, max_new and keep")
        if not it["prompt"] or (it["forced"] is not None and not it["forced"]):
            raise InputError(f"item {i}: an empty prompt or forced continuation")
        if it["forced"] is None and int(it["max_new"]) < 1:
            raise InputError(f"item {i}: max_new must be >= 1")
        ratio_for(int(it["keep"]), len(it["prompt"]))
        window = params.get("window_size")
        if window is not None and it["keep"] < len(it["prompt"]) and len(it["prompt"]) <= window:
            raise InputError(f"item {i}: {press} scores with the last {window} queries and needs a longer prompt "
                             f"than that to compress ({len(it['prompt'])} tokens)")


def kept_per_head(model: Any, cache: Any) -> list[int]:
    """Prompt tokens each layer keeps per KV head after the prefill: the cache's length, less (for AdaKV, which
    keeps the cache and masks keys instead) the layer's masked keys spread over its KV heads."""
    out = []
    for layer, block in zip(cache.layers, model.model.layers):
        n, heads = int(layer.keys.shape[2]), int(layer.keys.shape[1])
        masked = getattr(block.self_attn, "masked_key_indices", None)
        out.append(n - (len(masked[2]) // heads if masked is not None else 0))
    return out


def run_item(model: Any, item: dict[str, Any], press: Callable[[float], Any], eos_id: int | None) -> dict[str, Any]:
    import torch
    from transformers import DynamicCache
    prompt, forced, keep = [int(t) for t in item["prompt"]], item["forced"], int(item["keep"])
    length, ratio = len(prompt), ratio_for(keep, len(item["prompt"]))
    cache = DynamicCache()
    with torch.inference_mode():
        t0 = time.perf_counter()
        with press(ratio)(model):
            out = model(input_ids=torch.tensor([prompt]), past_key_values=cache, logits_to_keep=1)
        t1 = time.perf_counter()
        kept = kept_per_head(model, cache)
        if set(kept) != {keep}:         # the budget the row claims is the budget it ran at
            raise RuntimeError(f"the press kept {sorted(set(kept))} tokens per KV head, not {keep}")
        logits, steps = out.logits[0, -1], 0

        def step(token: int) -> Any:    # one token at its true position: the cache is shorter than the sequence
            nonlocal steps
            o = model(input_ids=torch.tensor([[token]]), past_key_values=cache,
                      position_ids=torch.tensor([[length + steps]]))
            steps += 1
            return o.logits[0, -1]

        res: dict[str, Any] = {}
        if forced is None:
            gen = [int(logits.argmax())]
            while len(gen) < int(item["max_new"]) and gen[-1] != eos_id:
                gen.append(int(step(gen[-1]).argmax()))
            res["generated"] = gen
        else:
            nll, hit = [], []
            for t, target in enumerate(int(x) for x in forced):
                logp = torch.log_softmax(logits.float(), dim=-1)
                nll.append(-float(logp[target]))
                hit.append(int(logp.argmax()) == target)
                if t + 1 < len(forced):
                    logits = step(target)
            res.update(nll=nll, hit=hit)
        t2 = time.perf_counter()
    return {**res, "prompt_len": length, "keep": keep, "compression_ratio": ratio, "evicted": keep < length,
            "kv_tokens_end": int(cache.layers[0].keys.shape[2]), "prefill_s": t1 - t0, "decode_s": t2 - t1}


def versions() -> dict[str, Any]:
    from importlib.metadata import version

    import torch
    import transformers
    return {"kvpress_version": version("kvpress"), "transformers_version": transformers.__version__,
            "torch_version": torch.__version__, "threads": torch.get_num_threads()}


def base_child() -> Any:
    """kvpress_child.py, imported by path (its folder is off sys.path, see above): its load_model builds the model."""
    spec = importlib.util.spec_from_file_location("kvpress_child_base", _HERE / "kvpress_child.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(spec: dict[str, Any], emit: Callable[[str, dict], None]) -> dict[str, Any]:
    press = spec.get("press")
    params = press_params(press, spec.get("params"))
    check_items(spec.get("items"), press, params)
    store = Path(spec.get("store") or "")
    if not (store / "manifest.json").is_file():
        raise InputError(f"no converted store at {store} (manifest.json missing)")
    eos_id = spec.get("eos_id")
    model = base_child().load_model(store, PRESSES[press][2])
    meta = {"press": press, "press_class": PRESSES[press][0], "params": params, "compression": COMPRESSION,
            "attn_implementation": model.config._attn_implementation, "dtype": "float32", "batch": 1,
            "eos_id": eos_id, **versions()}
    emit("meta", meta)
    items = []
    for i, item in enumerate(spec["items"]):
        items.append({"index": i, **run_item(model, item, lambda r: make_press(press, params, r), eos_id)})
        emit("item", items[-1])
    return {**meta, "items": items}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input", required=True, help="the items and the press (see the module's docstring)")
    p.add_argument("--json", required=True, help="where the results go")
    a = p.parse_args(argv)

    def emit(kind: str, obj: dict) -> None:
        print(kind, json.dumps(obj), flush=True)

    try:
        spec = json.loads(Path(a.input).read_text())
        if not isinstance(spec, dict):
            raise InputError("the input JSON must be an object")
        out = run(spec, emit)
    except (InputError, OSError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
