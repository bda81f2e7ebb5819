"""The settings that change a batch job's answers, recorded beside its output as `<output>.settings.json`.

A resume must give each pending id what the uninterrupted run would have given it, so the rerun must run with
the settings the output's lines were made with. What changes a text: the model and its weights, the device
(fp16 compute on a GPU, fp32 on a CPU), the KV and weight storage formats, the eviction policy and budget,
sampling (temperature; top-p, top-k and the seed only when sampling: greedy decoding ignores them; the seed also
when the random policy draws from it), the default number of new tokens and the stop strings. What does not is
left out on purpose, so that changing it never blocks a resume: the job guarantee (docs/cli.md, "What is
guaranteed") is that threads, placement (--percent), the block cut (--gpu-batch-size, --num-gpu-batches,
--prefill-batch-size), refill, the offload dir, logs and metrics leave every text as it is.

The file is written atomically before the first result line (so a line never exists without its settings) and
replaced by --overwrite. An output from before this file existed has lines and no record: it resumes and the
record is written then (its old lines' settings cannot be known). Stdlib only, like the rest of the CLI's checks.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from flexgen_h2o.config import ConfigError
from flexgen_h2o.files import real_path, write_atomic
from flexgen_h2o.kv.page_rule import DEFAULT_PAGE_SCORE, DEFAULT_PAGE_SIZE
from flexgen_h2o.kv.registry import DEFAULT_HEAD_FLOOR, cli_variants, trait

VERSION = 1
SUFFIX = ".settings.json"
BUDGET = ("hh_ratio", "recent_ratio", "hh_size", "recent_size", "sink_size", "kv_budget")
# how a differing key is named in the refusal: the flag that sets it
FLAGS = {"gen_len": "--gen-len (the default max_new_tokens)", "weights": "--path / --dummy-weights",
         "policy": "--policy / --h2o-variant / --full-cache"}


class OutputWriteError(OSError):
    """A write to a batch job's output or to its settings record failed (a full disk). What is on disk stays
    whole: the output is cut back to its last whole line (frontends/jsonl.py), the record is replaced atomically."""


def settings_path(output: str | os.PathLike) -> Path:
    """`<output>.settings.json` beside the output's real file (an alias of the output shares its record)."""
    real = real_path(output)
    return real.with_name(real.name + SUFFIX)


def _device(args: argparse.Namespace) -> str:
    """cpu or cuda: the compute dtype follows the device. No --device: whichever this machine would take."""
    if args.device:
        return "cuda" if str(args.device).startswith("cuda") else str(args.device)
    from flexgen_h2o.backend import cuda_is_available     # torch: only a batch job that got this far pays
    return "cuda" if cuda_is_available() else "cpu"


def answer_settings(args: argparse.Namespace, gen_len: int) -> dict[str, Any]:
    """The run's settings that change a text (module doc), normalised so two spellings of one run compare equal
    (--full-cache and no budget; stop strings in any order; a local model folder by its real path)."""
    model = str(real_path(args.model)) if os.path.isdir(os.path.expanduser(args.model)) else args.model
    weights = "dummy" if args.dummy_weights else (str(real_path(args.path)) if args.path else "default store")
    budget = {k: getattr(args, k) for k in BUDGET if getattr(args, k) is not None}
    policy = "full" if args.full_cache or not budget else cli_variants(args.policy).get(args.h2o_variant, args.policy)
    sampling = args.temperature > 0
    kv_bits = args.kv_bits or (4 if args.compress_cache else None)
    weight_bits = args.weight_bits or (4 if args.compress_weight else None)
    out: dict[str, Any] = {
        "version": VERSION, "model": model, "weights": weights, "device": _device(args),
        "kv_bits": kv_bits, "weight_bits": weight_bits,
        "group_size": args.group_size if kv_bits or weight_bits else None,
        "policy": policy, **{k: budget.get(k) for k in BUDGET}, "position_rolling": bool(args.position_rolling),
        # the values the rule runs with (a policy's default filled in), so spelling out a default is no change
        "score_window": _or_default(args.score_window, policy, "default_score_window"),
        "pool_kernel": _or_default(args.pool_kernel, policy, "default_pool_kernel"),
        # None when uniform, so a record from before head budgets existed still matches
        **_head_budgets(args, policy),
        **_page_selection(args),
        "temperature": float(args.temperature),
        "top_p": float(args.top_p) if sampling else None, "top_k": args.top_k if sampling else None,
        "seed": args.seed if sampling or policy == "random" else None,
        "stop": sorted(set(args.stop)), "gen_len": gen_len,
    }
    return out


def _head_budgets(args: argparse.Namespace, policy: str) -> dict[str, Any]:
    adaptive = policy != "full" and getattr(args, "head_budgets", "uniform") == "adaptive"
    floor = args.head_floor if getattr(args, "head_floor", None) is not None else DEFAULT_HEAD_FLOOR
    return {"head_budgets": "adaptive" if adaptive else None, "head_floor": float(floor) if adaptive else None}


def _page_selection(args: argparse.Namespace) -> dict[str, Any]:
    """The pages a step reads, or nothing (so a record from before page selection existed still matches)."""
    if getattr(args, "kv_select", "all") != "pages":
        return {}
    return {"kv_select": "pages", "page_size": args.page_size or DEFAULT_PAGE_SIZE, "fetch_ratio": args.fetch_ratio,
            "fetch_pages": args.fetch_pages, "page_score": args.page_score or DEFAULT_PAGE_SCORE,
            "dense_layers": args.dense_layers or 0,
            **({"page_ahead": True} if getattr(args, "page_ahead", None) else {})}    # older records still match


def _or_default(given: Any, policy: str, default: str) -> Any:
    if policy == "full":
        return None
    return given if given is not None else trait(policy, default)


def _flag(key: str) -> str:
    return FLAGS.get(key, "--" + key.replace("_", "-"))


def _show(v: Any) -> str:
    return "none" if v is None else json.dumps(v)


def check_settings(output: str | os.PathLike, settings: dict[str, Any]) -> bool:
    """An output with results is resumed: refuse (ConfigError, one line) when its recorded settings differ from
    this run's. Returns whether the record is there and equal (False: none yet, the caller writes it)."""
    path = settings_path(output)
    try:
        recorded = json.loads(path.read_text())
    except FileNotFoundError:
        return False                  # an output from before the record existed (module doc)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--output {output}: cannot read its settings {path} ({e}); pass --overwrite to start "
                          "over") from None
    if not isinstance(recorded, dict):
        raise ConfigError(f"--output {output}: {path} is not a settings record; pass --overwrite to start over")
    differ = [k for k in sorted(set(recorded) | set(settings)) if recorded.get(k) != settings.get(k)]
    if not differ:
        return True
    what = ", ".join(f"{_flag(k)} was {_show(recorded.get(k))}, now {_show(settings.get(k))}" for k in differ)
    raise ConfigError(f"--output {output} was made with other settings ({what}); rerun with its settings to resume "
                      "it, use another --output, or pass --overwrite to start over")


def save_settings(output: str | os.PathLike, settings: dict[str, Any]) -> None:
    """Write the record atomically (files.write_atomic): a reader sees the old record or the new."""
    path = settings_path(output)
    try:
        write_atomic(path, (json.dumps(settings, indent=1, sort_keys=True) + "\n").encode())
    except OSError as e:                # before the first line: nothing of the job is lost
        raise OutputWriteError(f"cannot write {path}: {e.strerror or e}; rerun the same command to resume "
                               "the job once it can be written") from None


def remove_settings(output: str | os.PathLike) -> None:
    settings_path(output).unlink(missing_ok=True)
