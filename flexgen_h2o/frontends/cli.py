"""The flags of `python -m flexgen_h2o.run`, with FlexGen's names where FlexGen has the flag (`docs/cli.md`).

Parsing is strict and cheap: no prefix matching (FlexGen's scripts relied on it), ranges checked by the flag
types, and any parse error is one line on stderr with exit code 2. Stdlib only, so bad flags fail in
milliseconds, before torch is imported.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn

from flexgen_h2o.config import OffloadPolicy
from flexgen_h2o.kv.page_rule import DEFAULT_PAGE_SIZE, KV_SELECT, PAGE_SCORES, PageRule
from flexgen_h2o.kv.registry import cli_policies, cli_variants, policy_help


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, exit 2 (argparse would print the whole usage first)."""
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def str2bool(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {v!r}")


def ratio(v: str) -> float:
    """A fraction of the prompt: 0 < r <= 1."""
    try:
        r = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {v!r}") from None
    if not 0.0 < r <= 1.0:
        raise argparse.ArgumentTypeError(f"{v} is not in (0, 1]: a ratio is a fraction of the prompt length "
                                         "(use --hh-size / --recent-size for slot counts)")
    return r


def share(v: str) -> float:
    """A share of something: 0 <= s <= 1."""
    try:
        r = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {v!r}") from None
    if not 0.0 <= r <= 1.0:
        raise argparse.ArgumentTypeError(f"{v} is not in [0, 1]")
    return r


def _int_at_least(low: int):
    def parse(v: str) -> int:
        try:
            n = int(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {v!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {n}")
        return n
    parse.__name__ = f"int>={low}"
    return parse


positive, count = _int_at_least(1), _int_at_least(0)


def nonempty(what: str):
    """A text flag that must not be "": an empty stop string matches at once (every answer would come back
    empty), and an empty prompt is refused in batch files too."""
    def parse(v: str) -> str:
        if not v:
            raise argparse.ArgumentTypeError(f"an empty {what} is not allowed")
        return v
    parse.__name__ = what
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m flexgen_h2o.run", allow_abbrev=False,
               description="Offloaded batch generation with an H2O KV cache. Modes: benchmark (default), "
                           "batch (--input/--output), prompts (--prompt). See docs/cli.md.")
    m = p.add_argument_group("model and weights")
    m.add_argument("--model", default="smollm2-135m", help="preset name, HF id, or local HF checkpoint folder")
    m.add_argument("--path", help="weight store folder (default ~/.cache/flexgen_h2o/<model>)")
    m.add_argument("--dummy-weights", action="store_true", help="deterministic random weights (timings only)")
    m.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when present)")
    s = p.add_argument_group("placement and schedule")
    s.add_argument("--offload-dir", default="~/flexgen_offload_dir",
                   help="root for disk-tier files; each run uses its own subfolder, removed at exit")
    s.add_argument("--percent", nargs="+", metavar="P",
                   help="W_GPU W_CPU CACHE_GPU CACHE_CPU ACT_GPU ACT_CPU: placement percents (0..100), disk takes "
                        "the rest of each pair; or `auto`: the placement, GPU batch and compression the cost model "
                        "predicts fastest (default: 100 0 100 0 100 0, or auto when that does not fit)")
    s.add_argument("--calibrate", action="store_true",
                   help="measure this machine's rates for the cost model again (cached after the first auto run)")
    s.add_argument("--gpu-batch-size", type=positive, default=4, help="sequences per GPU batch (default 4)")
    s.add_argument("--num-gpu-batches", type=positive, default=1, help="GPU batches per block (default 1)")
    s.add_argument("--prefill-batch-size", type=positive,
                   help="sequences per layer forward at prefill (default: 4096 prompt tokens' worth on a CPU, "
                        "16384 on a GPU); bounds the prompt's transients so a large GPU batch fits")
    s.add_argument("--uncached-disk-weights", action="store_true",
                   help="drop each disk-homed weight from the OS page cache after reading it, so every pass reads "
                        "the device, as when the model is larger than RAM (measures disk-bound streaming)")
    s.add_argument("--overlap", type=str2bool, default=True, help="prefetch and write back while computing")
    s.add_argument("--pin-weight", type=str2bool, default=True, help="pin host-resident weights (CUDA)")
    s.add_argument("--cpu-cache-compute", action="store_true", help="decode attention where the KV lives (host); "
                   "for a GPU compute device")
    s.add_argument("--sep-layer", type=str2bool, default=True, help="attention and MLP as separate schedule layers")
    s.add_argument("--skip-preflight", action="store_true", help="run even if the memory estimate does not fit")
    s.add_argument("--no-refill", action="store_true",
                   help="batch and prompts modes: synchronous blocks (each waits for its longest answer) instead of "
                        "continuous refill, where a finished row takes the next prompt (benchmark mode never refills)")
    s.add_argument("--refill-share", type=share, default=None,
                   help="refill once this share of the block's rows is free (default 0.25: fewer, fuller join "
                        "passes; 0 joins at the first free row)")
    c = p.add_argument_group("compression (FlexGen's group-wise min-max quantization)")
    c.add_argument("--compress-weight", action="store_true",
                   help="store weight matrices as group-wise int4 (or --weight-bits 8): fewer bytes on every tier "
                        "and link; dequantized beside the product")
    c.add_argument("--compress-cache", action="store_true",
                   help="store the KV cache as group-wise int4 (or --kv-bits 8): more sequences per budget")
    c.add_argument("--weight-bits", type=int, choices=(4, 8), help="bits per weight value (implies --compress-weight)")
    c.add_argument("--kv-bits", type=int, choices=(4, 8), help="bits per K/V value (implies --compress-cache)")
    c.add_argument("--group-size", type=positive, default=64, help="values per quantization group (default 64)")
    kv = p.add_argument_group("KV cache (H2O)")
    kv.add_argument("--hh-ratio", type=ratio, help="heavy hitters = int(r * prompt_len) of each prompt's own length "
                    "(the H2O HF code; --h2o-variant port takes the block's padded length, as the FlexGen port)")
    kv.add_argument("--recent-ratio", type=ratio, help="recent window = int(r * prompt_len); default: --hh-ratio")
    kv.add_argument("--hh-size", type=count, help="heavy-hitter slots (overrides --hh-ratio)")
    kv.add_argument("--recent-size", type=count, help="recent slots (overrides --recent-ratio)")
    kv.add_argument("--sink-size", type=count, help="first tokens always kept (attention sinks)")
    kv.add_argument("--kv-budget", type=positive, help="total slots per sequence, split evenly heavy/recent")
    kv.add_argument("--h2o-variant", choices=("exact", *cli_variants("h2o")), default="exact",
                    help="exact H2O; the FlexGen port's victim rule; or exact H2O ranking by each key's attention "
                         "averaged over the queries that saw it, not summed (less bias to old tokens)")
    kv.add_argument("--policy", choices=cli_policies(), default="h2o",
                    help="eviction rule when a budget is given: " + policy_help() + " (docs/cli.md \"Which policy\")")
    kv.add_argument("--full-cache", action="store_true", help="no eviction (the default when no budget is given)")
    kv.add_argument("--position-rolling", action="store_true",
                    help="Llama: rotate kept keys by their rank each step (runs past the context window)")
    kv.add_argument("--score-window", type=positive, metavar="N",
                    help="rank prompt tokens by the attention of the prompt's last N tokens only (a question at its "
                         "end), not of every token; decode steps add theirs as in H2O (snapkv's observation "
                         "window, default 32)")
    kv.add_argument("--pool-kernel", type=positive, metavar="K",
                    help="snapkv: average each prompt token's score over K neighbouring tokens (odd; default 31)")
    kv.add_argument("--head-budgets", choices=("uniform", "adaptive"), default="uniform",
                    help="adaptive: a layer's KV heads share its slots, taken by the best scores across them, each "
                         "head keeping at least --head-floor of its own share (AdaKV); decode then evicts within "
                         "each head (h2o, snapkv; default uniform: every head the same count)")
    kv.add_argument("--head-floor", type=float, metavar="F",
                    help="--head-budgets adaptive: the least share of its uniform budget a head keeps (default 0.2)")
    pg = p.add_argument_group("KV page selection (docs/page-selection.md)")
    pg.add_argument("--kv-select", choices=KV_SELECT, default="all",
                    help="pages: keep every token (on any tier) and let each decode step read only the pages of the "
                         "cache its query attends to most (--page-score), plus the first and the newest pages; all "
                         "(default): read the whole cache, or what eviction kept")
    pg.add_argument("--fetch-ratio", type=ratio, metavar="R",
                    help="--kv-select pages: the share of each sequence a step reads, in whole pages")
    pg.add_argument("--fetch-pages", type=positive, metavar="N", help="--kv-select pages: pages a step reads")
    pg.add_argument("--page-size", type=positive, metavar="T",
                    help=f"--kv-select pages: tokens per page (default {DEFAULT_PAGE_SIZE})")
    pg.add_argument("--page-score", choices=PAGE_SCORES,
                    help="--kv-select pages: rank pages by the query's attention to an int4 copy of the keys kept "
                         "where it computes (keys, the default), or by Quest's bound on each page's key min/max "
                         "(bound: less to keep, looser on RoPE models; docs/page-selection.md)")
    pg.add_argument("--dense-layers", type=count, metavar="N",
                    help="--kv-select pages: the first N attention layers read every page (default 0)")
    pg.add_argument("--page-ahead", action="store_true", default=None,
                    help="--kv-select pages: choose each layer's pages by the query its weights make of the previous "
                         "layer's input and read them while that layer computes (pays where the KV is on disk or "
                         "crosses to a GPU; docs/page-selection.md)")
    g = p.add_argument_group("generation")
    g.add_argument("--input", help="batch mode: JSONL, one {\"prompt\" (raw text) or \"messages\" (a chat), \"id\"?, "
                   "\"max_new_tokens\"?} per line, or OpenAI Batch API request lines (docs/cli.md)")
    g.add_argument("--output", help="batch mode: results JSONL; rerunning with the same file resumes")
    g.add_argument("--overwrite", action="store_true",
                   help="batch mode: start --output afresh instead of resuming (its results, parts and recorded "
                        "settings are replaced)")
    g.add_argument("--prompt", action="append", type=nonempty("prompt"),
                   help="prompts mode: a prompt (repeatable, non-empty), sent as one user turn through the chat "
                        "template when the tokenizer has one")
    g.add_argument("--no-chat-template", action="store_true", help="--prompt: send it as plain text. Batch files: "
                   "\"prompt\" lines are always plain text, and this flag makes chat (\"messages\") lines an error")
    g.add_argument("--prompt-len", type=positive, help="benchmark mode: corpus text cut to this many tokens (512)")
    g.add_argument("--gen-len", type=positive, help="new tokens per prompt (benchmark 32, otherwise 128)")
    g.add_argument("--cut-gen-len", type=positive, help="benchmark: run this many tokens and project decode to "
                   "--gen-len with FlexGen's formula (marked projected: True)")
    g.add_argument("--no-warmup", action="store_true", help="benchmark: skip the warm-up run")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 (default) = greedy")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: keep the smallest set of tokens whose probability reaches p (default 1.0 "
                        "= off; greedy ignores it)")
    g.add_argument("--top-k", type=count, default=0, help="keep the k most likely tokens (default 0 = off)")
    g.add_argument("--seed", type=int, default=0,
                   help="sampling seed (default 0); each prompt draws from its own generator, seeded by this and "
                        "its place in the input")
    g.add_argument("--stop", action="append", default=[], type=nonempty("stop string"),
                   help="stop string (repeatable, non-empty): the answer is cut before it")
    d = p.add_argument_group("scale-out (started by torchrun; docs/distributed.md)")
    d.add_argument("--pipeline-stages", type=positive, default=1,
                   help="split the layers over this many ranks (torchrun --nproc-per-node/--nnodes); 1 (default): "
                        "torchrun's ranks split the prompts of a batch job")
    d.add_argument("--stage-order", choices=("auto", "zigzag", "batches"), default="auto",
                   help="a pipeline stage whose weights are resident: batches (auto) takes each GPU batch through "
                        "the stage's layers in turn, so the stages compute at once; zigzag reads each weight once "
                        "per block and the stages take turns (a stage that streams weights always does this)")
    d.add_argument("--stage-percent", nargs=6, type=float, action="append", metavar="P",
                   help="a pipeline stage's placement, FlexGen's six numbers; repeat once per stage, in stage "
                        "order (default: --percent on every stage)")
    o = p.add_argument_group("output")
    o.add_argument("--log-file", help="append FlexGen's 5-line log here ('auto': FlexGen's fo-... file name)")
    o.add_argument("--metrics-json", help="write the run's metrics as JSON")
    o.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    return p


def placement(a: argparse.Namespace) -> tuple[list[float], str | None]:
    """--percent as six numbers, and whether the search chooses ("auto": asked for; "default": no placement flag,
    so the search takes over if the all-compute placement does not fit; None: the user's six numbers)."""
    if a.percent is None:
        return [100, 0, 100, 0, 100, 0], "default"
    if a.percent == ["auto"]:
        return [100, 0, 100, 0, 100, 0], "auto"
    try:
        numbers = [float(x) for x in a.percent]
    except ValueError:
        numbers = []
    if len(numbers) != 6:
        raise ValueError(f"--percent takes 6 numbers (W_GPU W_CPU CACHE_GPU CACHE_CPU ACT_GPU ACT_CPU) or `auto`, "
                         f"got {' '.join(a.percent)}")
    return numbers, None


def check_flags(a: argparse.Namespace) -> None:
    """Refuse flags that the rest of the flags would make do nothing (they used to be dropped silently)."""
    budget = [f"--{k.replace('_', '-')}" for k in ("hh_ratio", "recent_ratio", "hh_size", "recent_size", "sink_size",
                                                    "kv_budget") if getattr(a, k) is not None]
    if a.h2o_variant != "exact":
        if a.policy != "h2o":
            raise ValueError(f"--h2o-variant {a.h2o_variant} is a variant of --policy h2o, not of --policy "
                             f"{a.policy}; drop one of them")
        if not budget:
            raise ValueError(f"--h2o-variant {a.h2o_variant} needs a KV budget (--hh-ratio, --hh-size, --kv-budget, "
                             "...); without one the cache is full and nothing is evicted")
    if a.policy != "h2o" and not budget:
        raise ValueError(f"--policy {a.policy} needs a KV budget (--hh-ratio, --hh-size, --kv-budget, ...); "
                         "without one the cache is full and nothing is evicted")
    check_page_flags(a, budget)
    if a.head_floor is not None and a.head_budgets != "adaptive":
        raise ValueError("--head-floor sets the least share of a head under --head-budgets adaptive; add "
                         "--head-budgets adaptive or drop it")
    adaptive = "adaptive" if a.head_budgets == "adaptive" else None
    for flag, value in (("--score-window", a.score_window), ("--pool-kernel", a.pool_kernel),
                        ("--head-budgets", adaptive)):
        if value is not None and (a.full_cache or not budget):
            raise ValueError(f"{flag} ranks the prompt tokens an eviction keeps: it needs a KV budget "
                             "(--hh-ratio, --hh-size, --kv-budget, ...) and no --full-cache")


def check_page_flags(a: argparse.Namespace, budget: list[str]) -> None:
    page_flags = [f"--{k.replace('_', '-')}" for k in ("fetch_ratio", "fetch_pages", "page_size", "page_score",
                                                        "dense_layers", "page_ahead") if getattr(a, k) is not None]
    if a.kv_select != "pages":
        if page_flags:
            raise ValueError(f"{', '.join(page_flags)} set(s) what page selection reads; add --kv-select pages or "
                             "drop it")
        return
    if budget or a.policy != "h2o" or a.h2o_variant != "exact" or a.position_rolling:
        raise ValueError("--kv-select pages reads from a cache that keeps every token: drop the eviction flags "
                         "(--hh-ratio, --kv-budget, --policy, --position-rolling, ...) or drop --kv-select pages")
    if (a.fetch_ratio is None) == (a.fetch_pages is None):
        raise ValueError("--kv-select pages needs what a step reads: --fetch-ratio R (a share of each sequence) "
                         "or --fetch-pages N, one of them")
    if a.page_ahead and not getattr(a, "overlap", True):
        raise ValueError("--page-ahead reads a layer's pages while the layer before it computes, which needs the "
                         "overlapped schedule: drop --overlap false or drop --page-ahead")


def run_sampling(a: argparse.Namespace) -> dict:
    """The run's sampling settings, which an OpenAI request line may restate but not change."""
    return {"temperature": a.temperature, "top_p": a.top_p, "seed": a.seed, "stop": list(a.stop)}


def eviction_from_args(a: argparse.Namespace) -> Any:
    """EvictionConfig from the KV flags; no budget flag (or --full-cache) means a full cache."""
    from flexgen_h2o.kv import EvictionConfig
    sizes = dict(hh_ratio=a.hh_ratio, recent_ratio=a.recent_ratio, hh_size=a.hh_size, recent_size=a.recent_size,
                 sink_size=a.sink_size, kv_budget=a.kv_budget)
    given = [f"--{k.replace('_', '-')}" for k, v in sizes.items() if v is not None]
    if a.kv_select == "pages":
        given = {k: getattr(a, k) for k in ("page_size", "page_score", "dense_layers") if getattr(a, k) is not None}
        rule = PageRule(fetch_ratio=a.fetch_ratio, fetch_pages=a.fetch_pages, ahead=bool(a.page_ahead),
                        **{"score" if k == "page_score" else k: v for k, v in given.items()})
        return EvictionConfig(policy="full", pages=rule)
    if a.full_cache:
        if given:
            raise ValueError(f"--full-cache keeps every token; drop {', '.join(given)}")
        return EvictionConfig(policy="full", position_rolling=a.position_rolling)
    if not given:
        return EvictionConfig(policy="full", position_rolling=a.position_rolling)
    policy = cli_variants(a.policy).get(a.h2o_variant, a.policy)
    heads = {} if a.head_floor is None else {"head_floor": a.head_floor}
    return EvictionConfig(policy=policy, position_rolling=a.position_rolling, seed=a.seed,
                          score_window=a.score_window, pool_kernel=a.pool_kernel, head_budgets=a.head_budgets,
                          **heads, **sizes)


def log_file_name(a: argparse.Namespace, offload: OffloadPolicy, prompt_len: int, gen_len: int) -> str:
    """FlexGen's `--log-file auto` name: fo-{size}-gbs{G}-ngbs{N}-prompt{P}-gen{L}-percent-{...}-{cache}.log."""
    size = os.path.basename(a.model.rstrip("/")).split("-")[-1]
    pct = "-".join(f"{x:g}" for x in offload.percent)
    cache = "cpu-cache" if offload.cpu_cache_compute else "gpu-cache"
    compressed = ("-compw" if offload.weight_bits else "") + ("-compc" if offload.kv_bits else "")
    return (f"fo-{size}-gbs{offload.gpu_batch_size}-ngbs{offload.num_gpu_batches}-prompt{prompt_len}-gen{gen_len}"
            f"-percent-{pct}-{cache}{compressed}.log")


def compression_bits(a: argparse.Namespace) -> dict:
    """OffloadPolicy's kv_bits, weight_bits and group_size from the compression flags: FlexGen's --compress-*
    flags at its default of 4 bits, or the bits named."""
    return {"kv_bits": a.kv_bits or (4 if a.compress_cache else None),
            "weight_bits": a.weight_bits or (4 if a.compress_weight else None), "group_size": a.group_size}
