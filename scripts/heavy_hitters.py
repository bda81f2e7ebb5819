"""Where do H2O's heavy hitters sit in the few-shot summarization prompts? The prompt pass only, no generation.

For the harness's summarization items (flexgen_h2o.eval.data.summary_items) it runs the engine's scored prompt
pass (Engine.prefill), makes the engine's own prefill selection (the policy's select_prefill, as
KVCache.commit_prefill does) at one budget for each heavy share, and sorts the kept heavy hitters (kept, but not
in the recent window) of every layer and KV head into prompt segments: the demonstrations' documents and lead
sentences, the template text, the target document's first --opening tokens and the rest of it. It does so for
`h2o` (the column sum, which favours early keys) and for `h2o-avg` (the same candidates ranked by the average per
query that saw the key). The kept set is the one right after the prompt: decoding goes on evicting from it.

    python scripts/heavy_hitters.py --out benchmarks/results/heavy-hitters         # 100 items of <= 2,048 tokens
    python scripts/heavy_hitters.py --items 4 --prompt-len 512 --out /tmp/hh_try    # a quick look
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")          # spin-waiting threads slow a shared CPU badly
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from flexgen_h2o.config import ConfigError  # noqa: E402
from flexgen_h2o.eval.cli import OneLineParser  # noqa: E402
from flexgen_h2o.eval.data import SummaryItem, encode, split_lead, summary_items, summary_prompt_pieces  # noqa: E402
from flexgen_h2o.frontends.corpus import lee_articles  # noqa: E402
from flexgen_h2o.eval.grid import BudgetSpec, GridPoint, parse_budget, parse_heavy_share  # noqa: E402
from flexgen_h2o.eval.results import write_text_atomic  # noqa: E402
from flexgen_h2o.kv import Budget, EvictionPolicy  # noqa: E402
from flexgen_h2o.kv.select import expand_positions, newest_mask  # noqa: E402

SEGMENTS = ("demo_doc", "demo_summary", "template", "doc_opening", "doc_rest")
DEMO_DOC, DEMO_SUM, TEMPLATE, OPENING, DOC_REST = range(len(SEGMENTS))
RANKINGS = {"h2o": "h2o (column sum)", "h2o-avg": "h2o-avg (per-query average)"}


# --- prompt segments ---

ROLE_SEGMENT = {"template": TEMPLATE, "demo_doc": DEMO_DOC, "demo_summary": DEMO_SUM, "document": DOC_REST}


def prompt_pieces(item: SummaryItem) -> list[tuple[str, int]]:
    """The item's prompt text as (text, segment) pieces, from the harness's own prompt format
    (data.summary_prompt_pieces) and the examples the item holds. The document is DOC_REST; mark_opening relabels
    its start."""
    articles = lee_articles()
    shots = [split_lead(articles[i]) for i in item.shot_articles]
    target = split_lead(articles[item.article])
    if target is None or any(p is None for p in shots):
        raise RuntimeError(f"item {item.article}: a Lee article in it has no lead sentence")
    return [(text, ROLE_SEGMENT[role]) for text, role in summary_prompt_pieces(shots, target[1])]


def token_segments(tok, pieces: list[tuple[str, int]], ids: list[int]) -> list[int]:
    """Segment of every token. Boundaries come from tokenizing cumulative prefixes: a token that BPE merges
    across a cut (" The" after "Article: ") goes with the piece its merged form starts in the full prompt."""
    text = "".join(t for t, _ in pieces)
    full = encode(tok, text)
    if full != list(ids):
        raise RuntimeError("the segment pieces do not tokenize to the item's prompt tokens")
    segs: list[int] = []
    cut = 0
    for piece, seg in pieces:
        cut += len(piece)
        prefix = encode(tok, text[:cut])
        shared = next((i for i, (a, b) in enumerate(zip(prefix, full)) if a != b), min(len(prefix), len(full)))
        segs += [seg] * max(0, shared - len(segs))        # tokens only this prefix has are merged across the cut
    if len(segs) != len(full):
        raise RuntimeError(f"segments cover {len(segs)} of {len(full)} prompt tokens")
    return segs


def mark_opening(segs: list[int], opening: int) -> list[int]:
    """The target document's first `opening` tokens become OPENING."""
    out, left = list(segs), opening
    for i, s in enumerate(out):
        if s == DOC_REST and left > 0:
            out[i], left = OPENING, left - 1
    return out


def item_segments(tok, item: SummaryItem, opening: int) -> list[int]:
    return mark_opening(token_segments(tok, prompt_pieces(item), item.prompt), opening)


# --- the kept set ---

def select(policy: EvictionPolicy, score: Tensor, pos: Tensor, budget: Budget) -> tuple[Tensor, Tensor, Tensor]:
    """(kept, heavy, recent) (b, g, p) bool for a prefill's scores (b, g, p) and positions (b, p), -1 for pads."""
    positions = expand_positions(pos, score)
    valid = positions >= 0
    kept = policy.select_prefill(score, positions, budget)
    recent = newest_mask(positions, valid, budget.recent)
    evicts = valid.sum(-1, keepdim=True) > budget.budget            # shorter columns keep all: no heavy hitters
    heavy = kept & ~recent & (positions >= budget.sink) & evicts
    return kept, heavy, recent & kept


def segment_counts(mask: Tensor, seg: Tensor) -> Tensor:
    """mask (b, g, p) or (b, p) bool, seg (b, p) segment per token (-1 for pads) -> (b, g, S) or (b, S) counts."""
    onehot = torch.nn.functional.one_hot(seg.clamp(min=0), len(SEGMENTS)).float() * (seg >= 0)[..., None]
    if mask.dim() == 2:
        return torch.einsum("bp,bps->bs", mask.float(), onehot)
    return torch.einsum("bgp,bps->bgs", mask.float(), onehot)


def summarize(heavy: np.ndarray, cand: np.ndarray, open_kept: np.ndarray, fits: np.ndarray) -> dict:
    """heavy (N, L, G, S) heavy slots per segment; cand (N, S) tokens outside the recent window (and sinks);
    open_kept (N, L, G) share of the opening kept; fits (N,) the document lies inside the recent window."""
    tot = heavy.sum(-1, keepdims=True)
    shares = np.divide(heavy, tot, out=np.full(heavy.shape, np.nan), where=tot > 0)
    kept_sum = heavy.sum((0, 1, 2))
    avail = cand.sum(0) * heavy.shape[1] * heavy.shape[2]
    per_item_open = open_kept.mean((1, 2))

    def group(mask: np.ndarray) -> dict:
        return {"n": int(mask.sum()), "kept": float(per_item_open[mask].mean()) if mask.any() else None}

    with np.errstate(invalid="ignore"):        # a column without heavy slots has no share
        return {"heavy_share": dict(zip(SEGMENTS, np.nanmean(shares, (0, 1, 2)).tolist())),
                "candidate_share": dict(zip(SEGMENTS, (cand.sum(0) / max(cand.sum(), 1)).tolist())),
                "keep_rate": dict(zip(SEGMENTS, np.divide(kept_sum, avail, out=np.zeros(len(SEGMENTS)),
                                                          where=avail > 0).tolist())),
                "per_layer_heavy_share": np.nanmean(shares, (0, 2)).round(4).tolist(),
                "per_layer_opening_kept": open_kept.mean((0, 2)).round(4).tolist(),
                "opening_kept": {"fits": group(fits), "longer": group(~fits), "all": group(np.ones_like(fits))}}


def classify_block(policy: EvictionPolicy, bud: Budget, score: dict[int, Tensor], pos: Tensor,
                   seg: Tensor) -> dict:
    """One block's kept sets at one budget: heavy slots per (item, layer, head, segment), the segments' tokens
    outside the recent window, the share of the opening kept per (item, layer, head), and which documents fit."""
    heavy_l, open_l = [], []
    is_open = (seg == OPENING)[:, None, :]
    for lay in sorted(score):
        kept, heavy, _ = select(policy, score[lay], pos, bud)
        heavy_l.append(segment_counts(heavy, seg))
        open_l.append((kept & is_open).sum(-1) / is_open.sum(-1).clamp(min=1))
    # the recent window depends on positions only, the same in every layer and head
    window = newest_mask(pos[:, None], pos[:, None] >= 0, bud.recent)[:, 0]
    width = seg.shape[1]
    return {"heavy": torch.stack(heavy_l, 1).numpy(), "open": torch.stack(open_l, 1).numpy(),
            "cand": segment_counts((pos >= bud.sink) & ~window, seg).numpy(),
            "fits": [s.index(OPENING) >= width - bud.recent for s in seg.tolist()]}


def measure(runner, tok, items: list[SummaryItem], budget: BudgetSpec, shares: list[float | None], gen_len: int,
            opening: int, progress: bool = True) -> dict:
    """Prefill the items in the harness's blocks and classify each share's kept set under both rankings. A %
    budget is of a block's longest prompt + gen_len, so the blocks are run_summarization's: items sorted by
    prompt length (a stable sort), runner.batch_size at a time."""
    from tqdm import tqdm

    from flexgen_h2o.kv import policy_for

    items = sorted(items, key=lambda it: len(it.prompt))
    acc, per_item = {}, []
    bar = tqdm(total=len(items), unit="prompt", desc="prefill", disable=None if progress else True)
    for lo in range(0, len(items), runner.batch_size):
        block = items[lo:lo + runner.batch_size]
        width = max(len(it.prompt) for it in block)
        seg = torch.full((len(block), width), -1, dtype=torch.long)          # left-padded, as the engine pads
        for r, it in enumerate(block):
            seg[r, width - len(it.prompt):] = torch.tensor(item_segments(tok, it, opening))
        (pre,) = runner.engine.prefill([it.prompt for it in block])
        layers = sorted(pre.layers[0])
        score = {lay: torch.cat([g[lay][2] for g in pre.layers]) for lay in layers}
        pos = torch.cat([g[layers[0]][3] for g in pre.layers])
        del pre                                                # its K/V: ~0.75 GB a block of 16 x 2,048
        for share in shares:
            for ranking in RANKINGS:
                ev = GridPoint(ranking, budget, heavy_share=share).eviction(width + gen_len)
                bud = ev.resolve(width, gen_len)
                label = "even" if share is None else f"heavy {share:g}"
                a = acc.setdefault((label, ranking), {"heavy": [], "cand": [], "open": [], "fits": [], "slots": []})
                for key, value in classify_block(policy_for(ev, bud), bud, score, pos, seg).items():
                    a[key] += value if key == "fits" else [value]
                a["slots"].append((bud.budget, bud.heavy, bud.recent))
        per_item += [{"article": it.article, "prompt_len": len(it.prompt), "shots": it.shots,
                      "tokens": dict(zip(SEGMENTS, segment_counts(seg[r:r + 1] >= 0, seg[r:r + 1])[0].int().tolist()))}
                     for r, it in enumerate(block)]
        bar.update(len(block))
    bar.close()
    results: dict = {}
    for (label, ranking), a in acc.items():
        slots = np.array(a["slots"])
        out = summarize(*(np.concatenate(a[k]) for k in ("heavy", "cand", "open")), np.array(a["fits"]))
        out["slots"] = {n: [int(slots[:, i].min()), int(slots[:, i].max())]
                        for i, n in enumerate(("total", "heavy", "recent"))}
        out["heavy_slots_per_column"] = float(np.concatenate(a["heavy"]).sum(-1).mean())
        results.setdefault(label, {})[ranking] = out
    return {"items": per_item, "results": results}


# --- report ---

def render(data: dict) -> str:
    m, names = data["meta"], " | ".join(SEGMENTS)
    row = lambda name, values: f"| {name} | " + " | ".join(f"{x:.3f}" for x in values) + " |"  # noqa: E731
    lines = [f"# Heavy hitters in the summarization prompts ({m['model']}, {m['items']} items of <= {m['prompt_len']} "
             f"tokens, budget {m['budget']} of prompt + {m['gen_len']}, blocks of {m['batch_size']})", "",
             f"`{m['command']}`", "",
             "The kept set right after the prompt pass (the engine's prefill selection); heavy = kept outside the "
             "recent window. Heavy share: of one (prompt, layer, KV head)'s heavy slots, mean over all of them. Keep "
             "rate: heavy slots / the segment's tokens outside the recent window. The h2o-avg rows rank the "
             "same candidates by score / queries that saw the key (the engine's h2o-avg policy).", ""]
    items = data["items"]
    mean_tokens = {seg: sum(it["tokens"][seg] for it in items) / len(items) for seg in SEGMENTS}
    lines += [f"Mean prompt: {sum(it['prompt_len'] for it in items) / len(items):.0f} tokens, "
              f"{sum(it['shots'] for it in items) / len(items):.1f} examples; tokens per segment: "
              + ", ".join(f"{seg} {n:.0f}" for seg, n in mean_tokens.items()), ""]
    for label, by_ranking in data["results"].items():
        s = by_ranking["h2o"]["slots"]
        lines += [f"## {label}: {s['total'][0]}-{s['total'][1]} slots = {s['heavy'][0]}-{s['heavy'][1]} heavy + "
                  f"{s['recent'][0]}-{s['recent'][1]} recent", "", f"| | {names} |", "|---" * (len(SEGMENTS) + 1) + "|",
                  row("tokens outside the window", by_ranking["h2o"]["candidate_share"].values())]
        for ranking, what in RANKINGS.items():
            lines += [row(f"heavy share, {what}", by_ranking[ranking]["heavy_share"].values()),
                      row(f"keep rate, {what}", by_ranking[ranking]["keep_rate"].values())]
        lines.append("")
        for ranking, what in RANKINGS.items():
            o = by_ranking[ranking]["opening_kept"]
            fmt = lambda g: "n/a" if g["kept"] is None else f"{g['kept']:.3f}"  # noqa: E731
            lines.append(f"- opening ({m['opening']} tokens) kept, {what}: documents inside the recent window "
                         f"{fmt(o['fits'])} (n={o['fits']['n']}), longer {fmt(o['longer'])} (n={o['longer']['n']})")
        lines.append("")
    first = next(iter(data["results"]))
    r, c = data["results"][first]["h2o"], data["results"][first]["h2o-avg"]
    lines += [f"## Per layer, {first}, h2o: heavy share per segment; opening kept (all items)", "",
              f"| layer | {names} | opening kept | opening kept (h2o-avg) |", "|---" * (len(SEGMENTS) + 3) + "|"]
    lines += [row(str(i), [*shares, r["per_layer_opening_kept"][i], c["per_layer_opening_kept"][i]])
              for i, shares in enumerate(r["per_layer_heavy_share"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--items", type=int, default=100, help="summary items (the harness's --sum-items)")
    p.add_argument("--prompt-len", type=int, default=2048, help="the harness's --sum-prompt-len")
    p.add_argument("--gen-len", type=int, default=64, help="the harness's --sum-gen-len (a %% budget counts it)")
    p.add_argument("--budget", default="20%")
    p.add_argument("--heavy-shares", default="even,0.25", help="'even' (kv_budget's split) or fractions")
    p.add_argument("--opening", type=int, default=64, help="tokens of the target document counted as its opening")
    p.add_argument("--batch-size", type=int, default=16,
                   help="the harness's --batch-size, which sets each block's budget (accuracy.md's runs: 16)")
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when present)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/heavy-hitters"))
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    try:
        for name in ("items", "prompt_len", "gen_len", "opening", "batch_size"):
            if getattr(a, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
        budget = parse_budget(a.budget)
        shares = []
        for t in (x.strip() for x in a.heavy_shares.split(",") if x.strip()):
            try:
                value = None if t == "even" else float(t)
            except ValueError:
                raise ConfigError(f"--heavy-shares takes 'even' or fractions in [0, 1], got {t!r}") from None
            shares.append(parse_heavy_share(value))
        if not shares or len(set(shares)) != len(shares):
            raise ConfigError(f"--heavy-shares needs distinct entries, got {a.heavy_shares!r}")
        from flexgen_h2o.eval.runner import Runner
        from flexgen_h2o.loader import load_model
        from flexgen_h2o.models import ModelNameError
        from flexgen_h2o.weights import WeightStoreError
        torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))
        try:
            loaded = load_model(a.model, progress=not a.no_progress)
        except (ModelNameError, WeightStoreError) as e:
            raise ConfigError(str(e)) from None
        if loaded.tokenizer is None:
            raise ConfigError(f"{loaded.config.name} has no tokenizer in its store")
        items = summary_items(loaded.tokenizer, a.items, a.prompt_len)
        with Runner(loaded, batch_size=a.batch_size, progress=False, device=a.device) as runner:
            data = measure(runner, loaded.tokenizer, items, budget, shares, a.gen_len, a.opening,
                           progress=not a.no_progress)
        data["meta"] = {"model": loaded.config.name, "items": len(items), "prompt_len": a.prompt_len,
                        "gen_len": a.gen_len, "budget": budget.label, "heavy_shares": shares, "opening": a.opening,
                        "batch_size": a.batch_size, "segments": list(SEGMENTS),
                        "command": " ".join(["python scripts/heavy_hitters.py", *(argv or sys.argv[1:])])}
        a.out.mkdir(parents=True, exist_ok=True)
        md = render(data)
        write_text_atomic(a.out / "heavy_hitters.json", json.dumps(data, indent=1))
        write_text_atomic(a.out / "heavy_hitters.md", md)
    except (ConfigError, ValueError, OSError) as e:             # one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(md, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
