"""The CLI under torchrun: joining the job, a batch job's shared start and end, a data-parallel rank's share of
the prompts, the job's report, and a pipeline stage's layers, placement and link. run.py calls in here only when
torchrun started several ranks (docs/distributed.md)."""
from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any, Callable

from flexgen_h2o.config import ConfigError
from flexgen_h2o.frontends.cli import run_sampling
from flexgen_h2o.frontends.jsonl import read_requests
from flexgen_h2o.frontends.parts import DistributedJob, NullPart, RankPart, job_summary
from flexgen_h2o.frontends.settings import answer_settings


def reporting_rank(args: argparse.Namespace) -> int:
    """The rank whose stdout the user sees: the last stage of a pipeline (it samples), else rank 0."""
    return args.world.size - 1 if args.pipeline_stages > 1 else 0


def join(args: argparse.Namespace, mode: str) -> None:
    """Check the job's shape, join its process group (every rank passed the same checks), and for a pipeline
    stage fix its layers and placement."""
    from flexgen_h2o.backend import get_backend, rank_device
    world, stages = args.world, args.pipeline_stages
    if stages == 1 and mode != "batch":
        raise ConfigError(f"torchrun started {world.size} ranks: data-parallel runs are batch jobs (--input, "
                          "--output); for one model split across ranks pass --pipeline-stages")
    if stages > 1 and stages != world.size:
        raise ConfigError(f"--pipeline-stages {stages} needs as many ranks; torchrun started {world.size}")
    if stages > 1 and mode == "benchmark":
        raise ConfigError("--pipeline-stages runs batch (--input) and prompts (--prompt) modes")
    if args.stage_percent and len(args.stage_percent) != stages:
        raise ConfigError(f"--stage-percent is given {len(args.stage_percent)} times for {stages} stages: once "
                          "per stage, in stage order")
    if stages > 1 and args.percent == ["auto"]:
        raise ConfigError("--percent auto plans one process's placement; give each stage's with --stage-percent "
                          "(or one --percent for all)")
    cuda = get_backend(args.device).is_cuda
    if cuda and args.device in (None, "cuda"):
        args.device = rank_device(world.local_rank)
    world.init(cuda=cuda and stages > 1)
    args.stage = None
    if stages > 1:
        # rank 0 splits and tells the others: nodes with different cached rates must not cut differently
        args.split_by, split = world.broadcast(_split(args, stages, cuda) if world.is_main else None)
        args.stage = tuple(split[world.rank])
        if args.stage_percent:
            args.percent = [f"{x:g}" for x in args.stage_percent[world.rank]]
        elif args.percent is None:      # no search per stage yet: everything on its compute device
            args.percent = ["100", "0", "100", "0", "100", "0"]


def _split(args: argparse.Namespace, stages: int, cuda: bool) -> tuple[str, list[tuple[int, int]]]:
    """(what the split weighed, each stage's layer range), from this machine's cached rates if any."""
    from flexgen_h2o.calibrate import cached
    from flexgen_h2o.distributed.pipeline import split_layers
    from flexgen_h2o.models import resolve_model
    rates = cached(Path(os.path.expanduser(args.offload_dir)))    # measured before: the split never measures
    rates = (rates.get("gpu") or rates) if rates is not None and cuda else rates
    what = ("the cost model's decode time per layer" if rates is not None else
            "matrix FLOPs (no cached rates: python -m flexgen_h2o.calibrate)")
    return what, split_layers(resolve_model(args.model), stages, args.sep_layer, rates, args.gpu_batch_size)


def batch_job(args: argparse.Namespace, generate: Callable[..., int], gen_len: int) -> int:
    """A batch job across torchrun's ranks (frontends/parts.py): rank 0 reads and locks, each
    data-parallel rank (or a pipeline's last stage) appends to its part, rank 0 merges. generate(requests,
    pending, results) is the CLI's generation of the pending requests."""
    read = lambda: read_requests(args.input, gen_len, sampling=run_sampling(args),  # noqa: E731
                                 chat_template=not args.no_chat_template)
    with DistributedJob(args.world, args.output, overwrite=args.overwrite, read=read,
                        settings=answer_settings(args, gen_len)) as job:
        requests, pending = job.requests, job.pending
        writes = args.pipeline_stages == 1 or args.world.rank == args.world.size - 1
        results = RankPart(job) if writes else NullPart(job)
        if args.pipeline_stages == 1:
            args.dp_job = job
        if job.done:
            print(f"resuming {args.output}: {len(job.done)} of {len(requests)} ids already done (the output and "
                  f"{job.resumed_parts} part file(s) of earlier ranks)")
        if not pending:
            results.finalize(requests)
            print(f"nothing to do: all {len(requests)} ids of {args.input} are in {args.output}")
            return 0
        return generate(requests, pending, results)


def take_share(job: Any, prompts: list[list[int]], max_new: list[int]) -> list[int]:
    """The indices of this rank's share of the tokenized pending prompts (balanced by tokens), in input order."""
    return list(job.share([len(p) for p in prompts], max_new))


def idle_rank(args: argparse.Namespace, results: Any, requests: list) -> int:
    """More ranks than pending prompts: this one has nothing to generate, and still takes part in the end."""
    results.finalize(requests)
    report_job(args, {})
    return 0


def report_job(args: argparse.Namespace, metrics: dict) -> None:
    """Every rank's metrics to rank 0, which prints the job's line."""
    per_rank = args.world.gather({k: metrics.get(k) for k in ("prompts", "prompt_tokens", "generated_tokens",
                                                                "total_s") if k in metrics})
    if args.world.is_main:
        print(job_summary(per_rank))
        metrics["ranks"] = per_rank                # --metrics-json: every rank's share of the job


def stage_model(cfg: Any, stage: tuple[int, int]) -> Any:
    """The model as a stage's preflight counts it: its own transformer layers (the embedding and head are
    counted on every stage: an over-count of at most two tables)."""

    from flexgen_h2o.models import build_layers
    n = sum(1 for i, layer in enumerate(build_layers(cfg)) if stage[0] <= i < stage[1] and layer.kind == "attn")
    return dataclasses.replace(cfg, n_layers=max(1, n))


def attach_link(args: argparse.Namespace, llm: Any) -> None:
    """Give this stage's engine its link to the neighbours, and say which layers it holds."""
    from flexgen_h2o.distributed.pipeline import StageLink
    e, world = llm.engine, args.world
    # at the same block shape the batch order is the faster (docs/distributed.md, "Measured on this machine");
    # with one GPU batch the orders are one
    batch_major = args.stage_order != "zigzag"
    e.link = StageLink(world.rank, world.size, llm.config.hidden_size, e.compute_dtype, e.device,
                       world.data_group, batch_major)
    lo, hi = args.stage
    print(f"pipeline: stage {world.rank + 1} of {world.size} holds layers {lo}..{hi - 1} of {len(e.layers)} "
          f"({e.layers[lo].kind} .. {e.layers[hi - 1].kind}), split by {args.split_by}")
