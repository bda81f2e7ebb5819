"""What page selection reads (`--kv-select pages`): the rule, torch-free so the CLI can check it before torch loads.

The cache keeps every token (the full cache's slots, on whatever tiers the placement gives it); a decode step reads
only some pages of `page_size` consecutive tokens per (sequence, KV head): the first `sink_pages`, the last
`recent_pages` (the newest token's page among them), and the best of the rest by their score (`score`: the
query's attention to an int4 copy of the keys, or Quest's bound; kv/pages.py). `fetch_ratio` r reads int(r * n) of a sequence's n tokens, rounded up to whole
pages; `fetch_pages` N reads N pages. Either count includes the sink and recent pages, so "pages at 20 %" reads
a fifth of the cache, as H2O at 20 % keeps a fifth (`docs/page-selection.md`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# 32 tokens of a 64-wide fp16 head are 4 KiB: one page of one KV head is one aligned OS page of the offload file
# (docs/page-selection.md, "What it keeps and what it reads")
DEFAULT_PAGE_SIZE = 32
KV_SELECT = ("all", "pages")
# how a step ranks pages: "bound", Quest's bound from each page's per-channel key min and max; "keys", the attention
# the query gives each held token through an int4 copy of the keys kept where it computes, each page by its best
# token (the bound is loose on RoPE keys; docs/page-selection.md "Two scores")
PAGE_SCORES = ("bound", "keys")
DEFAULT_PAGE_SCORE = "keys"


@dataclass(frozen=True)
class PageRule:
    page_size: int = DEFAULT_PAGE_SIZE
    fetch_ratio: float | None = None     # share of the sequence read per step
    fetch_pages: int | None = None       # or pages read per step
    sink_pages: int = 1                  # always read: the attention sinks
    recent_pages: int = 2                # always read: the newest token's page and the one before it
    # the first attention layers read every page: their attention is spread over the whole context, so a bound
    # picks little there (Quest leaves its first two layers dense; docs/page-selection.md)
    dense_layers: int = 0
    score: str = DEFAULT_PAGE_SCORE
    # InfiniGen's read ahead: a layer's pages are chosen by the query its weights make of the previous schedule
    # layer's input, and read on the KV lane while that layer computes (schedule/executor.py _read_ahead; it pays
    # only where the KV lane has its own thread: docs/page-selection.md "Reading a layer ahead")
    ahead: bool = False

    def __post_init__(self) -> None:
        if self.score not in PAGE_SCORES:
            raise ValueError(f"page score must be one of {', '.join(PAGE_SCORES)}, got {self.score!r}")
        if (self.fetch_ratio is None) == (self.fetch_pages is None):
            raise ValueError("page selection reads a share of each sequence (--fetch-ratio) or a number of pages "
                             "(--fetch-pages): give exactly one")
        r = self.fetch_ratio
        if r is not None and (isinstance(r, bool) or not 0.0 < r <= 1.0):
            raise ValueError(f"fetch_ratio is the share of a sequence read per step and must be in (0, 1], got {r!r}")
        for name, least in (("page_size", 1), ("fetch_pages", 1), ("sink_pages", 0), ("recent_pages", 1),
                            ("dense_layers", 0)):
            n = getattr(self, name)
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < least):
                raise ValueError(f"{name} counts {'tokens' if name == 'page_size' else 'pages'} and must be an "
                                 f"integer >= {least}, got {n!r}")

    @property
    def forced(self) -> int:
        return self.sink_pages + self.recent_pages

    def pages_read(self, n_tokens: int) -> int:
        """Pages read for a sequence of n_tokens (the new one included): the fetch count, at least the sink and
        recent pages, at most every page the sequence has."""
        have = math.ceil(n_tokens / self.page_size)
        if self.fetch_pages is not None:
            want = self.fetch_pages
        else:
            want = math.ceil(int(self.fetch_ratio * n_tokens) / self.page_size)
        return min(have, max(want, self.forced))

    def skips(self, n_tokens: int) -> bool:
        """Whether a sequence of n_tokens leaves pages unread (else every step reads the whole cache)."""
        return self.pages_read(n_tokens) < math.ceil(n_tokens / self.page_size)

    def describe(self, prompt_len: int, gen_len: int, kv_bytes_per_token: float) -> str:
        """The startup line: what a step reads, and its bytes at the longest prompt's first and last steps
        (kv_bytes_per_token: one token's K and V across the layers and sequences counted)."""
        share = (f"{self.fetch_pages} pages" if self.fetch_pages is not None
                 else f"{self.fetch_ratio * 100:g}% of each sequence")
        first, last = prompt_len + 1, prompt_len + max(gen_len, 1)
        read = [self.pages_read(n) * self.page_size * kv_bytes_per_token / 1e6 for n in (first, last)]
        how = "bound on each page's keys" if self.score == "bound" else "attention to an int4 copy of the keys"
        if self.ahead:
            how += ", chosen a layer ahead"
        return (f"KV read per step: pages of {self.page_size} tokens, {share} (the first {self.sink_pages}, the "
                f"last {self.recent_pages}, the rest by the query's {how}) = {read[0]:.1f}-"
                f"{read[1]:.1f} MB of {first * kv_bytes_per_token / 1e6:.1f}-{last * kv_bytes_per_token / 1e6:.1f} "
                f"MB; nothing is evicted")
