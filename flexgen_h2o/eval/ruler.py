"""RULER's needle tasks niah_single_1, niah_multikey_2 and niah_multikey_3, built offline as lm-eval 0.4.13 builds them.

lm-eval generates these samples itself (lm_eval/tasks/ruler/prepare_niah.py) from a tokenizer and Python's global
`random`. Importing it pulls in datasets, pandas, pyarrow, scipy and scikit-learn, tries an NLTK download, and
builds a word list of millions of entries. This module reproduces that generator draw for draw for
the three tasks (their haystacks are repeated lines and other needles, not essays), with a random.Random(seed)
in place of the global generator: the samples equal lm-eval's after random.seed(seed) (tests/eval/test_ruler.py
compares them where lm-eval is importable). Only wonderwords is needed: RULER's word keys come from its lists.

Scoring is RULER's: greedy generation of up to 128 tokens after lm-eval's answer prefix, then string_match_all
(the share of expected values found in the output, case-insensitive).
"""
from __future__ import annotations

import bisect
import random
import re
import uuid
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import version
from typing import Any, Callable, Sequence

from flexgen_h2o.config import ConfigError, GenerationConfig
from flexgen_h2o.eval.grid import GridPoint
from flexgen_h2o.eval.results import BlockCheckpoint, ResultStore
from flexgen_h2o.eval.runner import Runner

# RULER's text, as lm-eval 0.4.13 has it (niah_utils.TEMPLATE, prepare_niah.NEEDLE and the "repeat" haystack)
TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
            "{type_needle_v} for {query} mentioned in the provided text?")
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
REPEAT_HAYSTACK = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
SHUFFLE_SEED = 42          # prepare_niah's fixed seed for the order of several needles
GEN_TOKENS = 128           # the tasks' max_gen_toks, also the room the sizing leaves for the answer


@dataclass(frozen=True)
class NiahConfig:
    """One RULER niah task: haystack kind and what keys and values are (lm-eval's niah_utils arguments)."""
    haystack: str          # "repeat" (the lines above) or "needle" (other needles with random keys and values)
    key: str               # words | numbers | uuids
    value: str
    num_k: int = 1
    num_v: int = 1
    num_q: int = 1


NIAH_TASKS = {"niah_single_1": NiahConfig("repeat", "words", "numbers"),
              "niah_multikey_2": NiahConfig("needle", "words", "numbers"),
              "niah_multikey_3": NiahConfig("needle", "uuids", "uuids")}
WONDERWORDS_PIP = "pip install wonderwords"


def wonderwords_module() -> Any:
    try:
        import wonderwords
    except ImportError:
        raise ConfigError(f"the ruler task needs the wonderwords package (RULER's keys come from its word lists): "
                          f"{WONDERWORDS_PIP}") from None
    return wonderwords


class KeyWords(Sequence[str]):
    """RULER's word keys: sorted(set(f"{adj}-{noun}")) over wonderwords' lists, 6.2M strings, without building
    them. Keys "adj-" sorted: a key's strings are its nouns in order, and blocks of different keys do not
    interleave, except where one key is a prefix of another ("x-" and "x-rated-"): such groups are merged by
    sorting their few thousand strings. random.choice needs only len() and indexing."""

    def __init__(self, adjectives: Sequence[str], nouns: Sequence[str]):
        self.nouns = sorted(set(nouns))
        self.starts: list[int] = []                    # first index of each block
        self.blocks: list[str | list[str]] = []        # a key (its nouns follow) or a merged group's strings
        keys = sorted({a + "-" for a in adjectives})
        total, i = 0, 0
        while i < len(keys):
            j = i + 1
            while j < len(keys) and keys[j].startswith(keys[i]):   # prefixed keys sort right after the prefix
                j += 1
            block: str | list[str] = (keys[i] if j == i + 1
                                      else sorted({k + n for k in keys[i:j] for n in self.nouns}))
            self.starts.append(total)
            self.blocks.append(block)
            total += len(self.nouns) if isinstance(block, str) else len(block)
            i = j
        self.total = total

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, index: int) -> str:              # type: ignore[override]
        if not 0 <= index < self.total:
            raise IndexError(index)
        b = bisect.bisect_right(self.starts, index) - 1
        block, offset = self.blocks[b], index - self.starts[b]
        return block + self.nouns[offset] if isinstance(block, str) else block[offset]


@lru_cache(maxsize=1)
def key_words() -> KeyWords:
    # the same lists lm-eval reads: RandomWord()._categories (a private attribute, as in prepare_niah)
    categories = wonderwords_module().RandomWord()._categories
    return KeyWords(categories["adjectives"], categories["nouns"])


def wonderwords_version() -> str:
    return version("wonderwords")


@dataclass
class RulerItem:
    task: str
    index: int             # sample number (lm-eval's "index")
    text: str              # lm-eval's "input": the template with the haystack
    answers: list[str]     # lm-eval's "outputs"
    query: str
    gen_prefix: str
    length: int            # lm-eval's "length": input tokens + the generation room
    depth: int             # percent of the haystack lines before the (first) needle
    prompt: list[int]      # what the model reads: input, a space, the answer prefix (lm-eval's plain-text prompt)


class _Draws:
    """prepare_niah's generate_random, drawing from one random.Random in the same order as the global one."""

    def __init__(self, rng: random.Random, words: Sequence[str]):
        self.rng, self.words = rng, words

    def __call__(self, kind: str) -> str:
        if kind == "numbers":
            return str(self.rng.randint(10 ** 6, 10 ** 7 - 1))       # 7 digits
        if kind == "words":
            return self.rng.choice(self.words)
        if kind == "uuids":
            return str(uuid.UUID(int=self.rng.getrandbits(128), version=4))
        raise ConfigError(f"unknown RULER needle type {kind!r}")


def niah_input(cfg: NiahConfig, num_haystack: int, draw: _Draws) -> tuple[str, list[str], str, int]:
    """prepare_niah.generate_input_output for the repeat and needle haystacks: (input text, answers, query,
    depth % of the first needle). Raises ValueError where the haystack cannot hold the needles."""
    keys, values, needles = [], [], []
    for _ in range(max(cfg.num_k, cfg.num_q)):
        keys.append(draw(cfg.key))
        values.append([])
        for _ in range(cfg.num_v):
            values[-1].append(draw(cfg.value))
            needles.append(NEEDLE.format(type_needle_v=cfg.value, key=keys[-1], value=values[-1][-1]))
    random.Random(SHUFFLE_SEED).shuffle(needles)
    if cfg.haystack == "repeat":
        lines = [REPEAT_HAYSTACK] * num_haystack
    elif cfg.haystack == "needle":
        # key before value, as the keyword arguments of lm-eval's format() call are evaluated
        lines = [NEEDLE.format(type_needle_v=cfg.value, key=draw(cfg.key), value=draw(cfg.value))
                 for _ in range(num_haystack)]
    else:
        raise ConfigError(f"RULER haystack {cfg.haystack!r} is not built offline (essays come from the HF hub)")
    at = sorted(draw.rng.sample(range(num_haystack), len(needles)), reverse=True)
    for index, needle in zip(at, needles):
        lines.insert(index, needle)
    chosen = draw.rng.sample(range(max(cfg.num_k, cfg.num_q)), cfg.num_q)
    queries = [keys[i] for i in chosen]
    answers = [v for i in chosen for v in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    template, kind = TEMPLATE, cfg.value
    if cfg.num_q * cfg.num_v == 1:                   # one answer: RULER turns the template singular
        for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            template = template.replace(old, new)
        kind = kind[:-1]
    depth = round(100 * min(at) / num_haystack)
    return template.format(type_needle_v=kind, context="\n".join(lines), query=query), answers, query, depth


def niah_samples(tok: Any, task: str, max_seq_length: int, n: int, seed: int = 0,
                 tokens_to_generate: int = GEN_TOKENS) -> list[RulerItem]:
    """prepare_niah.generate_samples: grow the haystack until input + answers + generation room reaches
    max_seq_length, then draw n samples (shrinking a sample's haystack while it is too long)."""
    if task not in NIAH_TASKS:
        raise ConfigError(f"unknown RULER task {task!r}; choose from {', '.join(NIAH_TASKS)}")
    cfg = NIAH_TASKS[task]
    draw = _Draws(random.Random(seed), key_words() if "words" in (cfg.key, cfg.value) else [])
    count: Callable[[str], int] = lambda text: len(tok(text).input_ids)      # noqa: E731  (lm-eval's count)
    num_needles = max(cfg.num_k, cfg.num_q) * cfg.num_v
    incremental = 5 if max_seq_length < 4096 else 25
    num_haystack, total = max(incremental, num_needles), 0
    while total + tokens_to_generate < max_seq_length:
        text, answers, _, _ = niah_input(cfg, num_haystack, draw)
        total = count(text + " ".join(answers))
        if total + tokens_to_generate > max_seq_length:
            num_haystack -= incremental
            break
        if num_haystack > max_seq_length:
            raise ConfigError(f"{task}: the haystack outgrew {max_seq_length} lines; the tokenizer under-counts")
        num_haystack += incremental
    num_haystack = max(num_haystack, num_needles)
    items = []
    for index in range(n):
        used, sample = num_haystack, None
        while used > 0:
            try:
                text, answers, query, depth = niah_input(cfg, used, draw)
                length = count(text) + tokens_to_generate
                if length <= max_seq_length:
                    sample = (text, answers, query, depth, length)
                    break
            except ValueError:                           # fewer lines than needles: lm-eval tries smaller
                pass
            used -= incremental
        if sample is None:                               # lm-eval skips such a sample too
            continue
        text, answers, query, depth, length = sample
        kind = cfg.value[:-1] if cfg.num_q * cfg.num_v == 1 else cfg.value
        verb = "is" if cfg.num_q * cfg.num_v == 1 else "are"
        prefix = f"The special magic {kind} for {query} mentioned in the provided text {verb}"
        # lm-eval's plain-text prompt: input, then the answer prefix after a space (build_qa_turn)
        prompt = list(tok.encode(text + " " + prefix, add_special_tokens=False))
        items.append(RulerItem(task, index, text, answers, query, prefix, length, depth, prompt))
    if not items:
        raise ConfigError(f"{task}: no sample fits {max_seq_length} tokens with {tokens_to_generate} to generate; "
                          "raise --ruler-len")
    return items


def postprocess_pred(text: str) -> str:
    """lm-eval ruler's postprocess_pred: control characters become newlines, then strip."""
    return re.sub(r"[\x00-\x1f]", "\n", text.strip()).strip()


def string_match_all(prediction: str, answers: list[str]) -> float:
    """RULER's metric for one sample: the share of expected values found in the output (case-insensitive)."""
    pred = prediction.lower()
    return sum(a.lower() in pred for a in answers) / len(answers)


def run_ruler(runner: Runner, store: ResultStore, items: dict[str, list[RulerItem]], points: list[GridPoint],
              gen_len: int) -> None:
    """One record per (task, point), keyed "<task>/<point>"; greedy generation, stopped at EOS or gen_len."""
    gen = GenerationConfig(max_new_tokens=gen_len, stop_at_eos=True)
    for task, its in items.items():
        todo = [p for p in points if not store.has(f"{task}/{p.key}")]
        if not todo:
            continue
        results = runner.generate_grid(todo, [it.prompt for it in its], gen, BlockCheckpoint(store, f"{task}/"),
                                       desc=task)
        for point in todo:
            _, texts, info = results[point.key]
            outputs = [postprocess_pred(t) for t in texts]
            scores = [string_match_all(o, it.answers) for o, it in zip(outputs, its)]
            store.put(f"{task}/{point.key}", {
                "task": task, "policy": point.policy, "budget": point.budget.label if point.budget else "full",
                "score": sum(scores) / len(scores), "scores": scores, "depths": [it.depth for it in its],
                "answers": [it.answers for it in its], "outputs": outputs, **info.as_dict()})
