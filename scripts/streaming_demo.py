"""Streaming demo: one long conversation, sample after sample, through ONE fixed-size H2O cache.

    python scripts/streaming_demo.py                       # SmolLM2, 24 Lee news articles (~10k tokens), ~10 min
    python scripts/streaming_demo.py --samples 4           # a quick look (~2 min)
    python scripts/streaming_demo.py --corpus wiki --sample-tokens 600

Each turn the user pastes a news article and asks for a one-sentence summary; the model answers until it ends
its turn (or --max-reply tokens), then the next article follows, in the same sequence, through the same cache of
sink + heavy + recent slots. With --position-rolling (the default) kept keys are re-rotated to their rank each
step, so the stream runs past SmolLM2's 8192-token window (seed 000's claim). The engine is driven by a scripted
`forced` sequence (flexgen_h2o.engine: article tokens are fed, SAMPLE lets the model talk, END stops), which
decides the next entry from what the model just said.

Writes to --out: transcript.md (every reply), stream.json (per-step memory and time, per-turn perplexity of the
article tokens) and stream.png (KV bytes and process RSS against tokens streamed, next to what a full cache
would need; per-step decode time).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from flexgen_h2o.config import GenerationConfig, OffloadPolicy  # noqa: E402
from flexgen_h2o.engine import Engine  # noqa: E402
from flexgen_h2o.frontends.corpus import lee_articles, wiki_articles  # noqa: E402
from flexgen_h2o.frontends.streaming import ConversationScript  # noqa: E402
from flexgen_h2o.kv import EvictionConfig  # noqa: E402
from flexgen_h2o.loader import load_model  # noqa: E402
from flexgen_h2o.metrics import rss_bytes  # noqa: E402


def build_turns(tok, corpus: str, samples: int, sample_tokens: int) -> list[list[int]]:
    texts = lee_articles() if corpus == "lee" else wiki_articles()
    turns = []
    for text in texts[:samples]:
        article = tok.decode(tok.encode(text, add_special_tokens=False)[:sample_tokens])
        ask = f"Summarize this news article in one sentence.\n\n{article}"
        turns.append(tok.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False))
    return turns


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/streaming_demo.py", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--corpus", choices=("lee", "wiki"), default="lee")
    p.add_argument("--samples", type=int, default=24, help="articles in the stream")
    p.add_argument("--sample-tokens", type=int, default=400, help="tokens of each article")
    p.add_argument("--max-reply", type=int, default=48)
    p.add_argument("--hh-size", type=int, default=96)
    p.add_argument("--recent-size", type=int, default=160)
    p.add_argument("--sink-size", type=int, default=4)
    p.add_argument("--no-rolling", action="store_true", help="keys at true positions (stays within the window)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/streaming"))
    a = p.parse_args(argv)
    torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))

    loaded = load_model(a.model)
    tok, cfg = loaded.tokenizer, loaded.config
    turns = build_turns(tok, a.corpus, a.samples, a.sample_tokens)
    end_of_turn = tok.encode("<|im_end|>\n", add_special_tokens=False)
    stop_ids = {i for i in (cfg.eos_id, tok.convert_tokens_to_ids("<|im_end|>")) if i is not None}
    script = ConversationScript(turns, end_of_turn, a.max_reply, stop_ids)
    prompt = script.prompt()
    upper = sum(len(t) for t in turns) + len(turns) * (a.max_reply + len(end_of_turn)) + 1
    ev = EvictionConfig(policy="h2o", hh_size=a.hh_size, recent_size=a.recent_size, sink_size=a.sink_size,
                        position_rolling=not a.no_rolling)
    engine = Engine(cfg, loaded.read, offload=OffloadPolicy(gpu_batch_size=1), eviction=ev, locate=loaded.locate)
    steps: list[dict] = []
    t0 = time.perf_counter()

    def on_step(t: int, seqs: list[int], logits: torch.Tensor) -> None:
        script.observe(t, logits[0])
        if t % 25 == 0:
            steps.append({"step": t, "tokens_streamed": len(prompt) + t, "rss_bytes": rss_bytes(),
                          "compute_tier_bytes": engine.tiers["compute"].current_bytes,
                          "elapsed_s": time.perf_counter() - t0})

    engine.on_step_logits = on_step
    gen = GenerationConfig(max_new_tokens=upper, stop_at_eos=False)
    result = engine.generate([prompt], gen, forced=[script])
    engine.close()
    return report(a, cfg, tok, script, steps, len(prompt) + len(result.token_ids[0]))


def report(a, cfg, tok, script: ConversationScript, steps: list[dict], streamed: int) -> int:
    a.out.mkdir(parents=True, exist_ok=True)
    kv_per_token = cfg.kv_bytes_per_token()
    slots = a.sink_size + a.hh_size + a.recent_size + 1
    turns = []
    lines = [f"# Streaming demo: {cfg.name}, {a.samples} {a.corpus} samples, one cache of {slots} slots/KV head",
             "", f"rolling: {not a.no_rolling}; tokens streamed: {streamed} (context window {cfg.max_seq_len})", ""]
    for i, reply in enumerate(script.replies[:script.turn + 1]):
        nll = script.nll[i]
        ppl = math.exp(sum(nll) / len(nll)) if nll else None        # turn 1 is the prompt: prefilled, not scored
        text = tok.decode(reply, skip_special_tokens=True).strip()
        turns.append({"turn": i, "user_tokens": len(nll), "user_turn_ppl": ppl, "reply": text})
        head = f"## Turn {i + 1}" + (f" (perplexity of the user turn's tokens {ppl:.2f})" if ppl else " (prompt)")
        lines += [head, "", text or "(no reply)", ""]
    (a.out / "transcript.md").write_text("\n".join(lines))
    data = {"config": {k: str(v) for k, v in vars(a).items()}, "tokens_streamed": streamed,
            "kv_cache_bytes": slots * kv_per_token, "full_cache_bytes_at_end": streamed * kv_per_token,
            "turns": turns, "steps": steps}
    (a.out / "stream.json").write_text(json.dumps(data, indent=2))
    plot(a.out / "stream.png", steps, slots * kv_per_token, kv_per_token, cfg.max_seq_len)
    rss = [s["rss_bytes"] for s in steps]
    print("\n".join(lines[:4]))
    for t in turns:
        ppl = f"{t['user_turn_ppl']:7.2f}" if t["user_turn_ppl"] else "prompt "
        print(f"turn {t['turn'] + 1:>3}: user-turn ppl {ppl} | {t['reply'][:100]}")
    if rss:
        half = rss[len(rss) // 2:]
        print(f"RSS over the stream: min {min(rss) / 2**20:.0f} MiB, max {max(rss) / 2**20:.0f} MiB; "
              f"second half {min(half) / 2**20:.0f}-{max(half) / 2**20:.0f} MiB; KV cache "
              f"{slots * kv_per_token / 2**20:.1f} MiB, a full cache would be {streamed * kv_per_token / 2**20:.1f} MiB")
    print(f"wrote {a.out / 'transcript.md'}, {a.out / 'stream.json'}, {a.out / 'stream.png'}")
    return 0


def plot(path: Path, steps: list[dict], kv_bytes: int, kv_per_token: int, window: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    if not steps:
        return
    x = [s["tokens_streamed"] for s in steps]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax.plot(x, [s["rss_bytes"] / 2**20 for s in steps], label="process RSS")
    ax.plot(x, [kv_bytes / 2**20] * len(x), label="H2O KV cache (allocated once)")
    ax.plot(x, [t * kv_per_token / 2**20 for t in x], "--", label="full KV cache would need")
    if x[-1] > window:
        ax.axvline(window, color="grey", ls=":", label="model context window")
    ax.set_xlabel("tokens streamed")
    ax.set_ylabel("MiB")
    ax.legend()
    ax.set_title("memory stays flat")
    t = [s["elapsed_s"] for s in steps]
    rate = [(t[i] - t[i - 1]) / max(x[i] - x[i - 1], 1) * 1000 for i in range(1, len(x))]
    ax2.plot(x[1:], rate)
    ax2.set_xlabel("tokens streamed")
    ax2.set_ylabel("ms per token (decode step)")
    ax2.set_title("step time stays flat")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
