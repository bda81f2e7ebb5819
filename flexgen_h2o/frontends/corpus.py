"""Real text shipped offline: the gensim test data (300 Lee news articles, a shortened English Wikipedia).

The package is located with importlib.util.find_spec; reading the files needs nothing from gensim itself.
"""
from __future__ import annotations

import bz2
import importlib.util
import re
from functools import lru_cache
from pathlib import Path

INSTALL_HINT = "pip install --no-deps gensim==4.4.0"


def test_data_dir() -> Path:
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.origin:
        raise FileNotFoundError(f"the bundled text corpus needs the gensim package: {INSTALL_HINT}")
    return Path(spec.origin).parent / "test" / "test_data"


@lru_cache(maxsize=1)
def lee_articles() -> list[str]:
    """300 ABC news articles, one per line."""
    path = test_data_dir() / "lee_background.cor"
    return [line.strip() for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]


@lru_cache(maxsize=1)
def wiki_articles(min_chars: int = 2000) -> list[str]:
    """Article texts of the shortened Wikipedia dump, with markup roughly stripped."""
    path = test_data_dir() / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
    xml = bz2.open(path, "rt", encoding="utf-8", errors="replace").read()
    texts = []
    for page in re.findall(r"<text[^>]*>(.*?)</text>", xml, flags=re.S):
        if page.lstrip().upper().startswith("#REDIRECT"):
            continue
        t = re.sub(r"\{\{.*?\}\}|<ref.*?</ref>|<[^>]+>|&lt;.*?&gt;", " ", page, flags=re.S)
        t = re.sub(r"\[\[(?:[^|\]]*\|)?([^\]]*)\]\]", r"\1", t)
        t = re.sub(r"'{2,}|={2,}|\[http\S*|\]", " ", t)
        t = re.sub(r"\s+", " ", t).strip()
        if len(t) >= min_chars:
            texts.append(t)
    return texts


def benchmark_prompts(tokenizer, n: int, prompt_len: int, vocab_size: int | None = None) -> list[list[int]]:
    """n prompts of exactly prompt_len real tokens: Lee articles joined end to end, cut into windows."""
    ids: list[int] = []
    for article in lee_articles():
        ids += tokenizer.encode(article + "\n\n", add_special_tokens=False)
        if len(ids) >= n * prompt_len:
            break
    while len(ids) < n * prompt_len:
        ids += ids
    if vocab_size is not None:
        ids = [i % vocab_size for i in ids]
    return [ids[i * prompt_len:(i + 1) * prompt_len] for i in range(n)]
