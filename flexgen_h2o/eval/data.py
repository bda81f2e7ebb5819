"""Task inputs as token ids, built from the text shipped offline (gensim's Lee news and Wikipedia sample).

Everything here is deterministic for given settings, so a resumed run scores exactly the same items.
"""
from __future__ import annotations

import html
from functools import lru_cache
import random
import re
from dataclasses import dataclass
from typing import Any

from flexgen_h2o.config import ConfigError
from flexgen_h2o.frontends.corpus import lee_articles, wiki_articles

CORPORA = ("wiki", "lee")
# a lead sentence ends at . ! or ? followed by a capital, a digit or a quote (Lee articles are plain prose)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'])")


def encode(tok: Any, text: str) -> list[int]:
    """Plain text -> ids without BOS/EOS, so windows cut from a long stream are all alike."""
    return list(tok.encode(text, add_special_tokens=False))


def corpus_stream(tok: Any, corpus: str, n_tokens: int) -> list[int]:
    """The corpus's articles joined by blank lines, tokenized until n_tokens ids exist."""
    if corpus not in CORPORA:
        raise ConfigError(f"unknown corpus {corpus!r}; choose from {', '.join(CORPORA)}")
    ids: list[int] = []
    for article in (_wiki() if corpus == "wiki" else lee_articles()):
        ids += encode(tok, article + "\n\n")
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
    raise ConfigError(f"the {corpus} corpus has only {len(ids)} tokens; {n_tokens} were asked for")


@lru_cache(maxsize=1)
def _wiki() -> list[str]:
    # the corpus reader strips markup but leaves HTML entities (&quot; ...), which no reader would see
    return [html.unescape(a) for a in wiki_articles()]


# --- perplexity ---

def perplexity_items(tok: Any, corpus: str, n: int, context: int,
                     continuation: int) -> list[tuple[list[int], list[int]]]:
    """n (context, continuation) pairs of exactly the given lengths.

    Wikipedia: the first context + continuation tokens of each article long enough (one window per article).
    Lee: its articles are ~250 tokens, so windows are cut end to end from the news stream (several articles
    each, like a news feed)."""
    total = context + continuation
    windows: list[list[int]] = []
    if corpus == "wiki":
        for article in _wiki():
            ids = encode(tok, article)
            if len(ids) >= total:
                windows.append(ids[:total])
                if len(windows) == n:
                    break
        if len(windows) < n:
            raise ConfigError(f"only {len(windows)} Wikipedia articles have {total} tokens; lower --ppl-items "
                              f"or --ppl-context/--ppl-continuation")
    else:
        stream = corpus_stream(tok, corpus, n * total)
        windows = [stream[i * total:(i + 1) * total] for i in range(n)]
    return [(w[:context], w[context:]) for w in windows]


# --- summarization (XSUM-style: the lead sentence is the reference) ---

@dataclass
class SummaryItem:
    article: int            # index in the Lee corpus
    prompt: list[int]
    reference: str          # the lead sentence
    shots: int              # few-shot examples in the prompt
    shot_articles: tuple[int, ...] = ()    # their indices in the Lee corpus, in prompt order


def split_lead(article: str) -> tuple[str, str] | None:
    parts = _SENTENCE_END.split(article, maxsplit=1)
    if len(parts) != 2:
        return None
    lead, rest = parts[0].strip(), parts[1].strip()
    if not 6 <= len(lead.split()) <= 60 or len(rest.split()) < 40:
        return None
    return lead, rest


SUMMARY_HEADER = "Summarize each news article in one sentence.\n\n"


def shot_pieces(lead: str, rest: str) -> list[tuple[str, str]]:
    """One few-shot example as (text, role) pieces; roles: template, demo_doc, demo_summary."""
    return [("Article: ", "template"), (rest, "demo_doc"), ("\nSummary: ", "template"), (lead, "demo_summary"),
            ("\n\n", "template")]


def summary_prompt_pieces(shots: list[tuple[str, str]], rest: str) -> list[tuple[str, str]]:
    """A summary prompt as (text, role) pieces, joined in order: the header, the (lead, rest) examples, and the
    document to summarize (role "document"). The one place the prompt's format is written."""
    pieces = [(SUMMARY_HEADER, "template")]
    for lead, shot_rest in shots:
        pieces += shot_pieces(lead, shot_rest)
    return pieces + [("Article: ", "template"), (rest, "document"), ("\nSummary:", "template")]


def _joined(pieces: list[tuple[str, str]]) -> str:
    return "".join(text for text, _ in pieces)


def summary_items(tok: Any, n: int, prompt_len: int) -> list[SummaryItem]:
    """n Lee articles as XSUM-style items, each prompt filled with other articles' (document, lead) pairs up to
    about prompt_len tokens, as H2O's XSUM prompts are few-shot prompts of ~2k tokens (seed 000)."""
    pairs = [(i, p) for i, a in enumerate(lee_articles()) if (p := split_lead(a)) is not None]
    shot_len = [len(encode(tok, _joined(shot_pieces(*p)))) for _, p in pairs]
    items: list[SummaryItem] = []
    for k, (idx, (lead, rest)) in enumerate(pairs):
        budget = prompt_len - len(encode(tok, _joined(summary_prompt_pieces([], rest))))
        if budget < 0:
            continue                                    # the document alone is longer than the prompt
        chosen: list[int] = []
        for j in range(1, len(pairs)):                  # the following articles, cyclically, as examples
            other = (k + j) % len(pairs)
            if shot_len[other] <= budget:
                chosen.append(other)
                budget -= shot_len[other]
            if budget < min(shot_len):
                break
        def prompt_ids() -> list[int]:
            return encode(tok, _joined(summary_prompt_pieces([pairs[o][1] for o in chosen], rest)))
        ids = prompt_ids()
        while len(ids) > prompt_len and chosen:         # token merges at joins can add a few ids
            chosen.pop()
            ids = prompt_ids()
        items.append(SummaryItem(idx, ids, lead, len(chosen), tuple(pairs[o][0] for o in chosen)))
        if len(items) == n:
            return items
    raise ConfigError(f"only {len(items)} Lee articles fit a {prompt_len}-token prompt; lower --sum-items or raise "
                      f"--sum-prompt-len")


# --- needle (passkey) ---

@dataclass
class NeedleItem:
    depth: int              # percent of the filler before the needle
    trial: int
    key: str
    prompt: list[int]
    answer: list[int]


NEEDLE_HEADER = "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
NEEDLE_QUESTION = "\n\nWhat is the pass key? The pass key is"
REPEAT_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def needle_items(tok: Any, length: int, depths: list[int], trials: int, filler: str = "wiki",
                 seed: int = 0) -> list[NeedleItem]:
    """A 5-digit pass key planted at each depth of a `length`-token prompt; trials differ in key and filler.
    filler "wiki": real Wikipedia text (each trial another stretch); "repeat": the classic repeated lines."""
    rng = random.Random(seed)
    head, question = encode(tok, NEEDLE_HEADER), encode(tok, NEEDLE_QUESTION)
    items = []
    for trial in range(trials):
        key = str(rng.randrange(10000, 100000))
        needle = encode(tok, f" The pass key is {key}. Remember it. {key} is the pass key. ")
        answer = encode(tok, f" {key}")
        n_fill = length - len(head) - len(needle) - len(question)
        if n_fill < 10:
            raise ConfigError(f"--needle-len {length} leaves no room for filler text; use at least 128")
        if filler == "repeat":
            rep = encode(tok, REPEAT_FILLER)
            fill = (rep * (n_fill // len(rep) + 1))[:n_fill]
        else:
            stream = corpus_stream(tok, "wiki", n_fill * (trial + 1))
            fill = stream[n_fill * trial:]
        for depth in depths:
            at = round(n_fill * depth / 100)
            items.append(NeedleItem(depth, trial, key, head + fill[:at] + needle + fill[at:] + question, answer))
    return items


# --- streaming ---

def stream_items(tok: Any, n_streams: int, length: int) -> list[list[int]]:
    """n_streams disjoint stretches of `length` tokens of the Wikipedia text, end to end across articles."""
    ids = corpus_stream(tok, "wiki", n_streams * length)
    return [ids[i * length:(i + 1) * length] for i in range(n_streams)]
