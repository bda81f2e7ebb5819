"""Which prompt keys a kvpress press keeps at prefill, per (prompt, layer, KV head): the outside check of our SnapKV
and TOVA scorers. Run by the kvpress virtualenv's interpreter (transformers < 5.3); never imports flexgen_h2o.

    <venv>/bin/python benchmarks/systems/kvpress_keep_child.py --store ~/.cache/flexgen_h2o/smollm2-135m \
        --ids ids.json --press snapkv --compression-ratio 0.5 --window-size 64 --kernel-size 5 --json OUT

The model is SmolLM2 as a LlamaForCausalLM from our converted store in fp32, built by kvpress_child.load_model.
Each prompt gets one prefill at batch 1 under the press. What is recorded is kvpress's own decision: the press's
`score` is wrapped to keep the tensor it returns, and its `compress` is wrapped to read the outcome. For SnapKV and
TOVA (ScorerPress.compress) the kept indices are `scores.topk(n_kept)` recomputed on that very tensor, and checked
against the keys compress actually gathered (exact equality, else the run fails); for AdaKV they are every index
but the ones kvpress wrote to `module.masked_key_indices`. JSON: prompts[p]["kept"][layer][kv_head] (sorted
indices) and prompts[p]["scores"][layer][kv_head] (the scores kvpress ranked by), plus versions and settings.

What each press keeps in kvpress 0.5.5 (L prompt tokens, W window, K kernel, R compression ratio; every press keeps
n_kept = max(1, int(L * (1 - R))) per KV head, kvpress.utils.compute_n_kept, clamped to at least 1):

- snapkv (SnapKVPress): the last W queries of the prompt attend to all L keys with the causal mask, softmax in
  fp32 over all L keys (window keys included, no renormalisation after the prefix is sliced out). Under sdpa the
  press recomputes these weights itself (queries re-projected and RoPE'd, scaled by 1/sqrt(head_dim)); under
  eager it slices the layer's own attention weights; the two are the same rule. The score of prefix key j < L - W
  is, per attention head, the mean over the W queries; then avg_pool1d(kernel K, stride 1, padding K // 2) over
  the prefix keys only, zero padding counted in the divisor (count_include_pad), so the first and last K // 2
  prefix keys are pooled with zeros, not with their neighbours in the window; then the mean over the GQA group of
  each KV head. The W window keys get max(all scores of the layer) + 1, so they are kept whenever n_kept >= W (if
  n_kept < W, which of the tied window keys survive is up to torch.topk). K must be odd: an even K gives L - W + 1
  pooled scores and the press's reshape fails. The press asserts L > W.
- tova (TOVAPress): the last query's attention over the first L - 1 keys (fp32 softmax over all L keys, the last
  one included), averaged over all attention heads of the layer and repeated for every KV head, so every KV head
  of a layer keeps the same indices. The last key gets max + 1, so it is always kept.
- adakv-snapkv (AdaKVPress around SnapKVPress): SnapKV's scores as above; the top n_safe = int(n_kept * alpha)
  (at least 1 when alpha > 0) of each KV head are raised to the fp32 max (the safeguard), then the
  H * (L - n_kept) lowest scores over all H KV heads of the layer together are masked. The layer keeps H * n_kept
  keys in total, unevenly over its heads; each head keeps at least n_safe. The window keys' max + 1 already puts
  them above every prefix score, so the safeguard's top n_safe are window keys first and it only protects prefix
  keys when n_safe > W. The cache is not shortened: masked keys are overwritten with a fake key at decode time.
  AdaKV refuses eager attention.

Ties (equal scores) are broken by torch.topk, which promises no order; the recorded scores let a caller tell a
tie from a real difference.
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
from typing import Any  # noqa: E402

# run as a script, this folder is sys.path[0], and its kvpress.py (the adapter) would shadow the kvpress package
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

PRESSES = ("snapkv", "tova", "adakv-snapkv")
ADAKV_ALPHA = 0.20          # AdaKVPress.alpha_safeguard's default in kvpress 0.5.5 (recorded with the actual value)


def base_child() -> Any:
    """kvpress_child.py, imported by path (its folder is off sys.path, see above): its load_model builds the model."""
    spec = importlib.util.spec_from_file_location("kvpress_child_base", _HERE / "kvpress_child.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build_press(a: argparse.Namespace) -> tuple[Any, Any]:
    """(the press hooked on the model, the ScorerPress whose `score` ranks the keys)."""
    import kvpress
    if a.press == "tova":
        p = kvpress.TOVAPress(compression_ratio=a.compression_ratio)
        return p, p
    snap = kvpress.SnapKVPress(compression_ratio=a.compression_ratio, window_size=a.window_size,
                               kernel_size=a.kernel_size)
    if a.press == "snapkv":
        return snap, snap
    kw = {} if a.alpha_safeguard is None else {"alpha_safeguard": a.alpha_safeguard}
    return kvpress.AdaKVPress(press=snap, **kw), snap


class Recorder:
    """Wraps the press's `compress` and its scorer's `score` on the instances (BasePress.__call__ hooks the bound
    forward_hook, which looks `compress` up on the instance) and keeps, per layer, what kvpress decided."""

    def __init__(self, press: Any, scorer: Any, adakv: bool) -> None:
        self.press, self.scorer, self.adakv = press, scorer, adakv
        self.kept: dict[int, list[list[int]]] = {}
        self.scores: dict[int, list[list[float]]] = {}
        self.safeguarded: dict[int, list[list[int]]] = {}
        self._score_out: list[Any] = []
        score, compress = scorer.score, press.compress      # the bound originals

        def wrapped_score(*args: Any, **kw: Any) -> Any:
            s = score(*args, **kw)
            self._score_out.append(s)           # the very tensor compress ranks (AdaKV then edits it in place)
            self._score_out.append(s.detach().clone())
            return s

        def wrapped_compress(module: Any, hidden_states: Any, keys: Any, values: Any, attentions: Any,
                             kwargs: dict) -> tuple[Any, Any]:
            self._score_out.clear()
            k_out, v_out = compress(module, hidden_states, keys, values, attentions, kwargs)
            if len(self._score_out) != 2:
                raise RuntimeError(f"layer {module.layer_idx}: compress called score "
                                   f"{len(self._score_out) // 2} times, expected once")
            live, before = self._score_out
            record = self._adakv if self.adakv else self._topk
            record(module, keys, k_out, live, before)
            self.scores[module.layer_idx] = before[0].tolist()
            return k_out, v_out

        scorer.score = wrapped_score
        press.compress = wrapped_compress

    def _topk(self, module: Any, keys: Any, k_out: Any, live: Any, before: Any) -> None:
        """ScorerPress.compress's own top-k on its own scores, checked against the keys it gathered."""
        from kvpress.utils import compute_n_kept
        n_kept = compute_n_kept(keys.shape[2], self.press.compression_ratio)
        idx = live.topk(n_kept, dim=-1).indices
        gathered = keys.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1]))
        if gathered.shape != k_out.shape or not bool((gathered == k_out).all()):
            raise RuntimeError(f"layer {module.layer_idx}: the recomputed top-k is not what compress kept")
        self.kept[module.layer_idx] = [sorted(h) for h in idx[0].tolist()]

    def _adakv(self, module: Any, keys: Any, k_out: Any, live: Any, before: Any) -> None:
        """AdaKV keeps the cache whole and lists the pruned (batch, head, position) in module.masked_key_indices."""
        import torch
        if k_out.shape != keys.shape:
            raise RuntimeError(f"layer {module.layer_idx}: AdaKVPress shortened the cache")
        b, h, s = (t.tolist() for t in module.masked_key_indices)
        n_heads, n = keys.shape[1], keys.shape[2]
        masked: list[set[int]] = [set() for _ in range(n_heads)]
        for bi, hi, si in zip(b, h, s):
            if bi != 0:
                raise RuntimeError("batch 1 expected")
            masked[hi].add(si)
        self.kept[module.layer_idx] = [[i for i in range(n) if i not in m] for m in masked]
        top = torch.finfo(live.dtype).max               # what the safeguard wrote into the scores
        self.safeguarded[module.layer_idx] = [torch.nonzero(row == top).flatten().tolist() for row in live[0]]

    def take(self, n_layers: int) -> dict[str, Any]:
        """The prompt's records, in layer order; an unhooked layer is an error, not a gap."""
        if sorted(self.kept) != list(range(n_layers)):
            raise RuntimeError(f"press ran on layers {sorted(self.kept)}, expected all {n_layers}")
        out: dict[str, Any] = {"kept": [self.kept[i] for i in range(n_layers)],
                               "scores": [self.scores[i] for i in range(n_layers)]}
        if self.adakv:
            out["safeguarded"] = [self.safeguarded[i] for i in range(n_layers)]
        self.kept, self.scores, self.safeguarded = {}, {}, {}
        return out


def settings(a: argparse.Namespace, press: Any) -> dict[str, Any]:
    s: dict[str, Any] = {"press": a.press, "kvpress_class": type(press).__name__,
                         "compression_ratio": a.compression_ratio}
    if a.press != "tova":
        s.update(window_size=a.window_size, kernel_size=a.kernel_size)
    if a.press == "adakv-snapkv":
        s.update(alpha_safeguard=press.alpha_safeguard)
    return s


def check_args(a: argparse.Namespace, prompt_len: int) -> None:
    if not 0 <= a.compression_ratio < 1:
        raise SystemExit("error: --compression-ratio must be in [0, 1)")
    if a.compression_ratio == 0:
        raise SystemExit("error: at --compression-ratio 0 kvpress skips scoring; nothing to record")
    if a.press != "tova":
        if prompt_len <= a.window_size:
            raise SystemExit(f"error: SnapKVPress needs prompts longer than --window-size {a.window_size}")
        if a.kernel_size < 1 or a.kernel_size % 2 == 0:
            raise SystemExit("error: --kernel-size must be odd (SnapKVPress's pooling keeps the length only then)")
    if a.press == "adakv-snapkv" and a.attn == "eager":
        raise SystemExit("error: AdaKVPress refuses eager attention")
    if a.press == "adakv-snapkv" and a.alpha_safeguard is not None and not 0 <= a.alpha_safeguard <= 1:
        raise SystemExit("error: --alpha-safeguard must be in [0, 1]")


def run(a: argparse.Namespace) -> dict[str, Any]:
    import kvpress
    import torch
    import transformers
    from kvpress.utils import compute_n_kept
    from transformers import DynamicCache

    ids_all = json.loads(Path(a.ids).read_text())
    lens = {len(x) for x in ids_all}
    if not ids_all or len(lens) != 1:
        raise SystemExit(f"error: {a.ids} must hold prompts of one length, got lengths {sorted(lens)}")
    prompt_len = lens.pop()
    check_args(a, prompt_len)
    child = base_child()
    t0 = time.perf_counter()
    model = child.load_model(Path(a.store), a.attn)
    load_s = time.perf_counter() - t0
    cfg = model.config
    press, scorer = build_press(a)
    rec = Recorder(press, scorer, adakv=a.press == "adakv-snapkv")
    prompts, prefill_s = [], []
    with torch.inference_mode(), press(model):
        for ids in ids_all:
            x = torch.tensor([ids], dtype=torch.long)
            t = time.perf_counter()
            model(input_ids=x, past_key_values=DynamicCache(), logits_to_keep=1)
            prefill_s.append(time.perf_counter() - t)
            prompts.append(rec.take(cfg.num_hidden_layers))
    return {"settings": settings(a, press), "prompt_len": prompt_len, "n_prompts": len(prompts),
            "n_kept": compute_n_kept(prompt_len, a.compression_ratio), "n_layers": cfg.num_hidden_layers,
            "n_heads": cfg.num_attention_heads, "n_kv_heads": cfg.num_key_value_heads,
            "attn_implementation": model.config._attn_implementation, "dtype": str(next(model.parameters()).dtype),
            "versions": {"kvpress": child._dist_version("kvpress"), "transformers": transformers.__version__,
                         "torch": torch.__version__},
            "threads": torch.get_num_threads(), "load_s": load_s, "prefill_s": prefill_s, "prompts": prompts,
            "kvpress_file": kvpress.__file__}


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--store", required=True)
    p.add_argument("--ids", required=True, help="JSON list of prompts (token id lists of one length)")
    p.add_argument("--press", required=True, choices=PRESSES)
    p.add_argument("--compression-ratio", type=float, required=True)
    p.add_argument("--window-size", type=int, default=64, help="SnapKV's observation window (kvpress's default)")
    p.add_argument("--kernel-size", type=int, default=5, help="SnapKV's pooling kernel (kvpress's default)")
    p.add_argument("--alpha-safeguard", type=float, default=None,
                   help=f"AdaKV's per-head share of n_kept (default: kvpress's, {ADAKV_ALPHA})")
    p.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa",
                   help="sdpa: the press recomputes the window's attention; eager: it reads the layer's weights")
    p.add_argument("--json", required=True)
    return p


def main() -> int:
    a = make_parser().parse_args()
    Path(a.json).write_text(json.dumps(run(a)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
