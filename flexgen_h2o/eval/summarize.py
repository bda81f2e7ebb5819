"""XSUM-style summarization: the lead sentence of a Lee article is the reference, the rest is the document.

Greedy generation until the first newline. ROUGE-1/2/L F-measures (rouge-score, Porter stemmer) against the
reference, and against the full-cache summary of the same item (fidelity: 1.0 means eviction changed nothing).
"""
from __future__ import annotations

from flexgen_h2o.config import ConfigError, GenerationConfig
from flexgen_h2o.eval.data import SummaryItem
from flexgen_h2o.eval.grid import GridPoint
from flexgen_h2o.eval.results import BlockCheckpoint, ResultStore
from flexgen_h2o.eval.runner import Runner

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


def rouge_scorer():
    try:
        from rouge_score.rouge_scorer import RougeScorer
    except ImportError:
        raise ConfigError("summarization needs rouge-score: pip install rouge-score") from None
    # no split_summaries: it needs NLTK's punkt_tab data, which is not shipped offline
    return RougeScorer(list(ROUGE_TYPES), use_stemmer=True)


def pair_rouge(scorer, target: str, prediction: str) -> dict[str, float]:
    """F-measure of each ROUGE type for one pair."""
    if target == prediction:                  # rouge-score gives 0 for two empty strings; identical is 1
        return dict.fromkeys(ROUGE_TYPES, 1.0)
    scores = scorer.score(target, prediction)
    return {t: scores[t].fmeasure for t in ROUGE_TYPES}


def mean_rouge(scorer, targets: list[str], predictions: list[str]) -> dict[str, float]:
    """Mean F-measure of each ROUGE type over the pairs."""
    pairs = [pair_rouge(scorer, t, p) for t, p in zip(targets, predictions)]
    return {t: sum(x[t] for x in pairs) / max(len(pairs), 1) for t in ROUGE_TYPES}


def first_line(text: str) -> str:
    return text.strip().split("\n")[0].strip()


def run_summarization(runner: Runner, store: ResultStore, items: list[SummaryItem], points: list[GridPoint],
                      gen_len: int) -> None:
    scorer = rouge_scorer()
    # sort by prompt length so a block pads little (a % budget is of the block's longest sequence)
    order = sorted(range(len(items)), key=lambda i: len(items[i].prompt))
    prompts = [items[i].prompt for i in order]
    refs = [items[i].reference for i in order]
    gen = GenerationConfig(max_new_tokens=gen_len, stop=("\n",), stop_at_eos=True)
    todo = [p for p in points if not store.has(p.key)]
    if not todo:
        return
    results = runner.generate_grid(todo, prompts, gen, BlockCheckpoint(store), desc="sum")
    for point in todo:                     # full first (make_grid's order): the others' fidelity needs it
        _, texts, info = results[point.key]
        summaries = [first_line(t) for t in texts]
        record = {"policy": point.policy, "budget": point.budget.label if point.budget else "full",
                  "vs_reference": mean_rouge(scorer, refs, summaries), "vs_full": None,
                  "articles": [items[i].article for i in order], "summaries": summaries, **info.as_dict()}
        if store.has("full"):
            full = store.get("full")["summaries"]
            record["vs_full"] = mean_rouge(scorer, full, summaries)
        store.put(point.key, record)
