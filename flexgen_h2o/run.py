"""`python -m flexgen_h2o.run`: offloaded generation with an H2O KV cache. Three modes:

- benchmark (no --input, no --prompt): FlexGen's runner on one block of real corpus text cut to --prompt-len
  tokens: warm-up, measured run, sizes, per-tier peaks, the 5-line log and a JSON record;
- batch (--input prompts.jsonl --output results.jsonl): every line generated, bucketed by length, written
  block by block, resumable;
- prompts (--prompt, repeatable): print the answers.

Before loading weights, a preflight compares the per-tier estimate with this machine and refuses (exit 2)
what would not fit. Bad input gives one line and exit 2, with nothing written.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")        # idle threads sleep: spinning ones take a shared CPU's cores
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from dataclasses import replace  # noqa: E402
from typing import Any  # noqa: E402

from flexgen_h2o.config import ConfigError, GenerationConfig, OffloadPolicy  # noqa: E402
from flexgen_h2o.distributed import RankStopped, world_from_env  # noqa: E402
from flexgen_h2o.frontends.cli import (build_parser, check_flags, compression_bits, eviction_from_args,  # noqa: E402
                                       log_file_name, placement, run_sampling)
from flexgen_h2o.frontends.jsonl import (OutputLock, ResultsFile, check_folder_writable,  # noqa: E402
                                         check_writable, generate_file, read_requests)
from flexgen_h2o.frontends.parts import QuietExit  # noqa: E402
from flexgen_h2o.frontends.scale_out import (attach_link, batch_job, idle_rank, join, report_job,  # noqa: E402
                                             reporting_rank, stage_model, take_share)
from flexgen_h2o.frontends.settings import answer_settings  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.world = world_from_env()              # under torchrun: this rank's place in the job
    if args.world is not None and args.world.rank != reporting_rank(args):
        args.no_progress = True                # one progress bar and one report per job
        if not os.environ.get("FLEXGEN_H2O_ALL_RANKS"):
            sys.stdout = open(os.devnull, "w")
    try:
        return _run(args)
    except KeyboardInterrupt:
        print("interrupted" + (f"; rerun the same command to resume {args.output}" if args.input else ""),
              file=sys.stderr)
        return 130
    except RankStopped:
        print(args.world.stopped_line(args.output), file=sys.stderr)
        return 143
    except (ConfigError, ValueError, OSError) as e:   # PreflightError (multi-line report) is a ConfigError
        if os.environ.get("FLEXGEN_H2O_DEBUG"):
            raise
        if isinstance(e, QuietExit):                   # rank 0 said it
            return 2
        rank = f"rank {args.world.rank}: " if args.world is not None and not args.world.is_main else ""
        if type(e).__name__ == "PreflightError":       # the report: numbers per resource and what to change
            print(rank + str(e), file=sys.stderr)
        else:
            print(f"error: {rank}" + " ".join(str(e).split("\n")), file=sys.stderr)
        return 2
    except RuntimeError as e:                          # a collective broke: a peer rank is gone
        if args.world is None or not ("Dist" in type(e).__name__ or "gloo" in str(e).lower()):
            raise
        print(args.world.stopped_line(args.output), file=sys.stderr)
        return 143
    finally:
        if args.world is not None:
            args.world.close()


def _mode(args: argparse.Namespace) -> str:
    if args.input:
        if args.prompt:
            raise ConfigError("--input and --prompt are two modes; give one of them")
        if not args.output:
            raise ConfigError("--input needs --output (results.jsonl; rerunning with it resumes)")
        if os.path.realpath(args.input) == os.path.realpath(args.output):     # a symlink of the input too
            raise ConfigError("--output must differ from --input")
        mode = "batch"
    else:
        if args.output:
            raise ConfigError("--output goes with --input (batch mode)")
        mode = "prompt" if args.prompt else "benchmark"
    if mode != "benchmark":
        for flag in ("prompt_len", "cut_gen_len"):
            if getattr(args, flag) is not None:
                raise ConfigError(f"--{flag.replace('_', '-')} is for benchmark mode (no --input, no --prompt)")
    elif args.no_refill or args.refill_share is not None:
        raise ConfigError("benchmark mode runs FlexGen's synchronous blocks and never refills: --no-refill and "
                          "--refill-share are for batch (--input) and prompts (--prompt) modes")
    if args.refill_share is not None and args.no_refill:
        raise ConfigError("--refill-share sets when a refill happens; drop it or --no-refill")
    return mode


def _run(args: argparse.Namespace) -> int:
    # --- cheap checks first: nothing heavy is imported and nothing is written until they pass ---
    mode = _mode(args)
    check_flags(args)
    if args.world is not None:
        join(args, mode)
    elif args.pipeline_stages > 1 or args.stage_percent or args.stage_order != "auto":
        raise ConfigError("--pipeline-stages, --stage-percent and --stage-order split the model across ranks that "
                          "torchrun starts: torchrun --nproc-per-node S -m flexgen_h2o.run --pipeline-stages S ...")
    percent, args.auto = placement(args)
    offload = OffloadPolicy.from_percent(percent, gpu_batch_size=args.gpu_batch_size,
                                         num_gpu_batches=args.num_gpu_batches, overlap=args.overlap,
                                         prefill_batch_size=args.prefill_batch_size,
                                         uncached_disk_weights=args.uncached_disk_weights,
                                         pin_weight=args.pin_weight, cpu_cache_compute=args.cpu_cache_compute,
                                         sep_layer=args.sep_layer, **compression_bits(args)).validate()
    gen_len = args.gen_len or (32 if mode == "benchmark" else 128)
    prompt_len = args.prompt_len or 512
    if args.cut_gen_len is not None and not 4 <= args.cut_gen_len < gen_len:
        raise ConfigError(f"--cut-gen-len must be >= 4 and below --gen-len ({gen_len}), got {args.cut_gen_len}")
    log_path = log_file_name(args, offload, prompt_len, gen_len) if args.log_file == "auto" else args.log_file
    for flag, path in (("--output", args.output), ("--log-file", log_path), ("--metrics-json", args.metrics_json)):
        if path:
            check_writable(path, flag)
    if mode != "batch":
        return _generate(args, mode, offload, eviction_from_args(args), gen_len, prompt_len, log_path,
                         None, None, None)
    if args.world is not None:
        return batch_job(args, lambda *a: _generate(args, mode, offload, eviction_from_args(args), gen_len,
                                                        prompt_len, log_path, *a), gen_len)
    # one run per output, locked before the output is read; removed on every way out but SIGKILL, whose lock
    # the kernel drops, so a killed run's rerun is never blocked
    with OutputLock(args.output):
        requests = read_requests(args.input, gen_len, sampling=run_sampling(args),
                                 chat_template=not args.no_chat_template)
        results = ResultsFile(args.output, overwrite=args.overwrite, settings=answer_settings(args, gen_len))
        done = results.load(requests)
        pending = [r for r in requests if r.key not in results.done]
        if results.repaired:
            print(f"{args.output}: dropped a torn last line; it will be generated again")
        if done:
            print(f"resuming {args.output}: {done} of {len(requests)} ids already done")
        if not pending:
            results.finalize(requests)
            print(f"nothing to do: all {len(requests)} ids of {args.input} are in {args.output}")
            return 0
        eviction = eviction_from_args(args)
        return _generate(args, mode, offload, eviction, gen_len, prompt_len, log_path, requests, pending, results)


def _load(args: argparse.Namespace, *, dummy_on_disk: bool = False) -> Any:
    from flexgen_h2o.loader import load_model
    from flexgen_h2o.weights import WeightStoreError
    try:
        return load_model(args.model, path=args.path, dummy_weights=args.dummy_weights,
                          dummy_on_disk=dummy_on_disk, progress=not args.no_progress)
    except WeightStoreError as e:
        msg = str(e)
        if "cannot be downloaded" in msg:    # the hub and the loader both append the hint: say it once
            msg = (msg.split("; convert a local")[0] + "; convert a local checkpoint with `python -m "
                   f"flexgen_h2o.convert /path/to/hf_folder --model {args.model}`, or pass --dummy-weights")
        raise ConfigError(msg) from None


def _generate(args, mode, offload, eviction, gen_len, prompt_len, log_path, requests, pending, results) -> int:
    """Flags are checked; now: the model, the prompts checked once (plan_job), the preflight, the LLM, the mode."""
    import torch

    from flexgen_h2o.api import LLM
    from flexgen_h2o.backend import get_backend
    from flexgen_h2o.loader import fallback_tokenizer
    from flexgen_h2o.models import resolve_model
    from flexgen_h2o.planner import summary_line
    from flexgen_h2o.planner.job import plan_job

    if args.world is None:
        torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))
    else:                          # torchrun sets OMP_NUM_THREADS=1: the ranks on a node split its cores instead
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // args.world.local_size))
    cfg = resolve_model(args.model)
    backend = get_backend(args.device)
    if offload.cpu_cache_compute and not backend.is_cuda:      # the compute device already is the host
        where = "--device cpu" if args.device else "no GPU found"
        raise ConfigError(f"--cpu-cache-compute applies when the compute device is a GPU, and here it is the CPU "
                          f"({where}); drop the flag")
    # dummy weights homed on disk become a store on disk: write it only after the preflight said it fits (and
    # after the search chose where they live)
    deferred = args.dummy_weights and (args.auto is not None or offload.weights_on_disk)
    loaded = None if deferred else _load(args)
    tok = fallback_tokenizer() if deferred else loaded.tokenizer
    texts, prompts, max_new, label = _prompts(args, mode, cfg, tok, offload, pending, prompt_len, gen_len)
    refill = mode != "benchmark" and not args.no_refill       # benchmark mode keeps FlexGen's synchronous blocks

    def plan(offload, prompts, max_new, label):       # the job's one plan (planner/job.py), handed down from here
        return plan_job(cfg, offload, eviction, [len(p) for p in prompts], max_new, label=label, refill=refill,
                        device_type=backend.compute_device.type, compute_itemsize=backend.compute_dtype.itemsize)

    job = plan(offload, prompts, max_new, label)      # every rank checks every prompt, then keeps its share
    if getattr(args, "dp_job", None) is not None:
        keep = take_share(args.dp_job, prompts, max_new)
        if not keep:
            return idle_rank(args, results, requests)
        pending, prompts, max_new = [pending[i] for i in keep], [prompts[i] for i in keep], [max_new[i] for i in keep]
        label = lambda i: f"{args.input}: line {pending[i].line}"  # noqa: E731
        job = job.replan(keep=keep, label=label)
    prediction = None
    if args.auto:
        # a benchmark's --cut-gen-len runs fewer steps and reports the full length: the plan is for the full one
        offload, prediction = _auto(args, cfg, eviction, backend, offload, job, gen_len if mode == "benchmark"
                                    else max(job.max_new))
        if prediction is not None and mode == "benchmark":   # a block of placeholder prompts: its size may change
            texts, prompts, max_new, label = _prompts(args, mode, cfg, tok, offload, pending, prompt_len, gen_len)
            job = plan(offload, prompts, max_new, label)
        elif prediction is not None:
            job = job.replan(offload=offload, label=label)
    on_disk = args.dummy_weights and offload.weights_on_disk
    stage = getattr(args, "stage", None)          # a pipeline stage: its own layers are checked
    est, checked = _preflight(args, cfg if stage is None else stage_model(cfg, stage), offload, eviction, backend,
                              on_disk, job)
    if mode == "benchmark":
        from flexgen_h2o.frontends.benchmark import corpus_prompts, sizes_line
        prompts, source = corpus_prompts(tok, offload.block_size, prompt_len, cfg.vocab_size)
        print(f"prompts: {len(prompts)} x {prompt_len} tokens of {source}")
        print(sizes_line(cfg, est, len(prompts), prompt_len))
    print(summary_line(checked) if checked else "preflight: skipped (--skip-preflight)")
    if prediction is None and stage is None:   # a given placement: predicted where this machine's rates are cached
        from flexgen_h2o.frontends.auto import predict_if_calibrated
        prediction = predict_if_calibrated(args, est, checked, len(prompts),
                                           gen_len if mode == "benchmark" else None)
    elif prediction is not None and checked:
        prediction.peak_bytes = {c.resource: c.need for c in checked}

    if loaded is None:
        loaded = _load(args, dummy_on_disk=on_disk)
    llm = LLM.from_loaded(loaded, offload=offload, eviction=eviction, device=args.device,
                          offload_dir=args.offload_dir, preflight=False, progress=not args.no_progress,
                          refill=refill, refill_share=args.refill_share, stage=stage)
    if stage is not None:
        attach_link(args, llm)
    print(_invariance_line(llm.engine))
    try:
        metrics = _run_mode(args, mode, llm, est, texts, prompts, job, gen_len, requests, pending, results)
    finally:
        llm.close()
    if prediction is not None:
        from flexgen_h2o.frontends.auto import report
        print(report(prediction, metrics))
    if getattr(args, "dp_job", None) is not None:
        report_job(args, metrics)
    _write_logs(args, metrics, log_path)
    return 0


def _auto(args, cfg, eviction, backend, offload, job, gen_len) -> tuple:
    """--percent auto, or no --percent and the all-compute placement does not fit: the searched plan and its
    prediction ((offload, None): the default placement fits, nothing searched)."""
    from flexgen_h2o.formats import WEIGHT_FORMAT
    from flexgen_h2o.frontends.auto import choose
    from flexgen_h2o.planner import PreflightError, preflight
    kw = dict(prompt_len=max(job.lens), gen_len=gen_len)
    if args.auto == "default":
        try:
            preflight(cfg, offload, eviction, backend=backend, n_seqs=min(offload.block_size, len(job.lens)),
                      real_weights=not args.dummy_weights, **kw)
            return offload, None
        except PreflightError:
            why = "no --percent given and everything on the compute device does not fit"
    else:
        why = "--percent auto"
    store_bytes = WEIGHT_FORMAT.nbytes(cfg.n_params()) if args.dummy_weights else 0
    return choose(args, cfg, eviction, backend, offload, n_prompts=len(job.lens), dummy_store_bytes=store_bytes,
                  why=why, **kw)


def _prompts(args, mode, cfg, tok, offload, pending, prompt_len, gen_len) -> tuple:
    """(texts, token ids, max_new_tokens per prompt, a label naming prompt i in errors) of this mode. Benchmark
    mode's ids are placeholders of the right length: the corpus is tokenized once the preflight passed."""
    from flexgen_h2o.schedule.blocks import encode_prompts
    chat = not args.no_chat_template and bool(getattr(tok, "chat_template", None))
    if mode == "benchmark":
        prompts = [[0] * prompt_len] * offload.block_size
        return None, prompts, [args.cut_gen_len or gen_len] * len(prompts), (lambda i: "--prompt-len")
    if mode == "prompt":
        prompts = encode_prompts(tok, args.prompt, chat=chat)
        return args.prompt, prompts, [gen_len] * len(prompts), (lambda i: f"--prompt #{i + 1}")
    # a "prompt" line is raw text, a "messages" line a chat (refused under --no-chat-template when read)
    chats = [r for r in pending if r.messages is not None]
    if chats and tok is not None and not getattr(tok, "chat_template", None):
        raise ConfigError(f"{args.input}: line {chats[0].line}: a chat (messages) needs a chat template, and the "
                          f"tokenizer of {cfg.name} has none; send the text as a prompt")
    prompts = encode_prompts(tok, [r.prompt if r.messages is None else r.messages for r in pending], chat=False)
    return (None, prompts, [r.max_new_tokens for r in pending],
            (lambda i: f"{args.input}: line {pending[i].line}"))


def _preflight(args, cfg, offload, eviction, backend, deferred, job) -> tuple:
    """The per-tier estimate of the largest block against this machine (est, checked; checked None with
    --skip-preflight), after the run's header lines."""
    from flexgen_h2o.formats import WEIGHT_FORMAT
    from flexgen_h2o.kv import describe_rows
    from flexgen_h2o.memory.offload_dir import sweep_stale

    from flexgen_h2o.planner import preflight
    from flexgen_h2o.planner.memory import kv_row_bytes, kv_slot_bytes, plan_bytes
    from flexgen_h2o.weights import default_store_path
    plan = job.peak if cfg is job.model else replace(job.peak, model=cfg)     # a pipeline stage counts its layers
    if offload.uses_disk:
        check_folder_writable(args.offload_dir, "--offload-dir")
        # before the preflight's disk check: folders of killed runs would count against the free space
        sweep_stale(os.path.expanduser(args.offload_dir))
    store = args.path or str(default_store_path(cfg.name + "-dummy"))
    new_store = deferred and not os.path.isfile(os.path.join(store, "manifest.json"))
    weights = dict(dummy_store_bytes=WEIGHT_FORMAT.nbytes(cfg.n_params()) if new_store else 0,
                   real_weights=not args.dummy_weights)
    if args.skip_preflight:
        est, checked = plan_bytes(plan, **weights), None
    else:
        est, checked = preflight(cfg, offload, eviction, backend=backend, store_dir=store if new_store else None,
                                 offload_root=os.path.expanduser(args.offload_dir) if offload.uses_disk else None,
                                 plan=plan, **weights)
    print(f"model: {cfg.name} ({cfg.family}, {cfg.n_layers} layers, width {cfg.hidden_size}) | {len(job.lens)} "
          f"prompt(s), block {offload.block_size} = {offload.gpu_batch_size} x {offload.num_gpu_batches} | "
          f"--percent {' '.join(f'{x:g}' for x in offload.percent)}")
    # slot bytes as allocated: K, V, score, position
    print(describe_rows(job.budgets, job.lens, job.max_new,
                        kv_slot_bytes(cfg, offload.kv_format) * cfg.n_layers * plan.n_seqs))
    if eviction.pages is not None:
        print(eviction.pages.describe(max(job.lens), max(job.max_new),
                                      kv_row_bytes(cfg, offload.kv_format) * cfg.n_layers * plan.n_seqs))
    print(est.plan.describe())
    return est, checked


def _invariance_line(engine) -> str:
    """What a prompt's text may owe to its batch-mates here (docs/cli.md, "What is guaranteed")."""
    if engine.kernels.batch_invariant and engine.device.type == "cpu":
        return "batch invariance: bit for bit (compiled kernels: any batch, block, tier or resume gives the same tokens)"
    return ("batch invariance: to rounding (a text may part from its batch-1 text at a near-tie of two logits"
            + (", or where int4/int8 rounding crosses a step" if engine.offload.kv_bits or engine.offload.weight_bits
               else "") + ")")


def _run_mode(args, mode, llm, est, texts, prompts, job, gen_len, requests, pending, results) -> dict:
    """Run the mode on the LLM; its metrics."""
    from flexgen_h2o.frontends.benchmark import memory_line, run_benchmark, run_metrics, summary
    # newer placements charge resident weights to the tiers; then the peaks must not add them again
    weights_in_tiers = any(t.current_bytes for t in llm.engine.tiers.values())
    if mode == "benchmark":
        sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        return run_benchmark(llm, prompts, gen_len=gen_len, cut_gen_len=args.cut_gen_len, sampling=sampling,
                             warmup=not args.no_warmup, weights_in_tiers=weights_in_tiers,
                             show_sample=not args.dummy_weights)
    gen = _gen_config(args, gen_len)
    from flexgen_h2o.metrics import peak_rss_bytes, reset_peak_rss
    load_peak, rss_window = peak_rss_bytes(), reset_peak_rss()    # as benchmark mode: the generation's own peak
    if mode == "prompt":
        outs = {}
        for block in llm.generate_blocks(prompts, gen, job.max_new, progress=not args.no_progress, job=job):
            outs.update({i: t for i, t in zip(block.indices, block.texts)})
        for i, t in enumerate(texts):
            print(f"\n>>> {t}\n{outs[i].strip()}")
        totals = dict(llm.last_metrics)
    else:
        totals = generate_file(llm, requests, pending, prompts, results, gen, input_name=args.input,
                               progress=not args.no_progress, job=job)
        print(f"\nwrote {len(requests)} results to {args.output} ({len(pending)} generated now)")
    metrics = run_metrics(llm, totals, est, mode, weights_in_tiers, len(prompts))
    metrics.update(peak_rss_bytes=max(load_peak, peak_rss_bytes()),
                   peak_rss_run_bytes=peak_rss_bytes() if rss_window else None)
    print(summary(metrics))
    print(memory_line(metrics))
    return metrics


def _write_logs(args: argparse.Namespace, metrics: dict, log_path: str | None) -> None:
    """FlexGen's log lines (printed, and appended to --log-file) and --metrics-json."""
    from flexgen_h2o.metrics import flexgen_log
    log = flexgen_log(metrics)
    print(log, end="")
    if args.world is not None and args.world.rank != reporting_rank(args):
        return                                     # one log and one metrics file per job
    if log_path:
        with open(log_path, "a") as f:
            f.write(log)
    if args.metrics_json:
        with open(args.metrics_json, "w") as f:
            json.dump(metrics, f, indent=2, default=str)


def _gen_config(args: argparse.Namespace, gen_len: int) -> Any:
    return GenerationConfig(max_new_tokens=gen_len, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, stop=tuple(args.stop)).validate()


if __name__ == "__main__":
    sys.exit(main())
