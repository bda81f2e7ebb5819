"""kvpress's presses (NVIDIA kvpress 0.5.5) as extra rows of the grid: kvpress-snapkv, kvpress-tova, kvpress-adakv,
kvpress-observed, beside the engine's policies on the same items, blocks and budgets.

kvpress pins an older transformers, so the rows run in its own virtualenv, in a child process of the repository's
benchmarks package (benchmarks/systems/kvpress_eval.py, the BRIDGE). The library never imports benchmarks: the
bridge is looked up here with importlib when a kvpress row is asked for, and a missing package or virtualenv is
one `error:` line before the model loads.

Budget: at a grid point the engine gives every sequence of a block `GridPoint.slots(longest prompt + new tokens)`
KV slots; a kvpress row keeps that many prompt tokens per KV head (all of a shorter prompt). The presses compress
at prefill only: the cache then grows by one token per step, where the engine's policies stay at their slots. So
the rows run where the prompt is most of the sequence and the answer is read right after it (ruler, haystack,
summarization); perplexity, needle and streaming are refused (UNSUPPORTED).
"""
from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Sequence

from flexgen_h2o.config import ConfigError, GenerationConfig
from flexgen_h2o.eval.grid import PEER_PREFIX, GridPoint, is_peer
from flexgen_h2o.sampling import StopTracker

BRIDGE = "benchmarks.systems.kvpress_eval"          # run_items(...) and venv_reason(), see its docstring
WHY = ("kvpress's presses compress the prompt at prefill only and do not evict during a long teacher-forced "
       "continuation, so their cache would outgrow the engine's policies' and the comparison would not be at "
       "equal cache")
UNSUPPORTED = {"perplexity": WHY, "needle": WHY,
               "streaming": "a stream is teacher-forced far past its short prefill; " + WHY}


def peer_rows(policies: Sequence[str]) -> list[str]:
    return [p for p in policies if is_peer(p)]


def check_peer_tasks(policies: Sequence[str], tasks: Sequence[str], stream_policies: Sequence[str] = ()) -> None:
    """Refuse kvpress rows on a task they cannot run at equal cache (one line: ConfigError)."""
    rows = peer_rows(policies)
    for task in tasks:
        named = peer_rows(stream_policies) if task == "streaming" else rows
        if named and task in UNSUPPORTED:
            raise ConfigError(f"{', '.join(named)} cannot run the {task} task: {UNSUPPORTED[task]}; run them with "
                              f"--tasks ruler,haystack,summarization")


def bridge() -> ModuleType:
    """The benchmarks module that runs kvpress, found when a row needs it (run from the repository root)."""
    try:
        return importlib.import_module(BRIDGE)
    except ImportError as e:
        raise ConfigError(f"kvpress rows need the repository's benchmarks package ({BRIDGE}: {e}); run "
                          "`python -m flexgen_h2o.eval` from the repository root") from None


def check_peer_ready() -> None:
    """The bridge imports and the kvpress virtualenv exists (it is never created here: that runs pip)."""
    reason = bridge().venv_reason()
    if reason:
        raise ConfigError(reason)


def check_peer_model(loaded: Any) -> None:
    """The child builds a LlamaForCausalLM from the converted store's manifest and .npy tensors."""
    cfg = loaded.config
    if loaded.store_path is None or not (Path(loaded.store_path) / "manifest.json").is_file():
        raise ConfigError("kvpress rows read the model's converted weight store; --dummy-weights has none")
    if cfg.family != "llama" or cfg.rope_scaling:
        raise ConfigError(f"kvpress rows build a Llama (plain RoPE) from the store; {cfg.name} is {cfg.family}")


def peer_grid(point: GridPoint, prompts: Sequence[Sequence[int]], blocks: list[range], *, store: Path,
              eos_id: int | None, decode: Callable[[list[int]], str] | None, gen: GenerationConfig | None = None,
              continuations: Sequence[Sequence[int]] | None = None, checkpoint: Any = None,
              on_block: Callable[[int], None] | None = None) -> list[dict]:
    """One kvpress row over the runner's blocks: the saved dict of each block, as Runner._grid makes them
    ({"result", "slots", "evicted", "seconds", ...}): result is the engine's per-block shape, {"tokens", "texts"}
    for generation (gen), a list of {"nll", "hit"} for teacher forcing (continuations). Blocks in `checkpoint`
    are reused; the others run in one child, and each is checkpointed as soon as its last item is back.
    on_block(steps): progress."""
    if (gen is None) == (continuations is None):
        raise ValueError("give gen (generation) or continuations (teacher forcing), not both")
    if gen is not None and not gen.greedy:
        raise ConfigError(f"{point.policy} decodes greedily (kvpress's pipeline); this task samples")
    saved: list[dict | None] = [checkpoint.get(point.key, bi) if checkpoint is not None else None
                                for bi in range(len(blocks))]
    items: list[dict] = []
    owner: list[tuple[int, int]] = []                       # item -> (block, row)
    slots: dict[int, int] = {}
    for bi, blk in enumerate(blocks):
        if saved[bi] is not None:
            continue
        steps = max(len(continuations[i]) for i in blk) if continuations is not None else gen.max_new_tokens
        slots[bi] = point.slots(max(len(prompts[i]) for i in blk) + steps)
        for row, i in enumerate(blk):
            forced = list(continuations[i]) if continuations is not None else None
            items.append({"prompt": list(prompts[i]), "forced": forced,
                          "max_new": len(forced) if forced is not None else gen.max_new_tokens,
                          "keep": min(slots[bi], len(prompts[i]))})
            owner.append((bi, row))
    if items:
        got: dict[int, list[dict | None]] = {bi: [None] * len(blocks[bi]) for bi in slots}

        def on_item(res: dict, meta: dict) -> None:
            bi, row = owner[res["index"]]
            got[bi][row] = res
            if all(r is not None for r in got[bi]):
                saved[bi] = block_record(got[bi], slots[bi], meta, gen, eos_id, decode)   # type: ignore[arg-type]
                if checkpoint is not None:
                    checkpoint.put(point.key, bi, saved[bi])
                if on_block is not None:
                    on_block(max(len(r["nll"] if gen is None else r["generated"]) for r in got[bi]))

        eos = eos_id if gen is None or gen.stop_at_eos else None
        bridge().run_items(store, point.policy[len(PEER_PREFIX):], items, eos, on_item)
    missing = [bi for bi, s in enumerate(saved) if s is None]
    if missing:
        raise RuntimeError(f"{point.key}: the kvpress child returned no results for blocks {missing}")
    return saved                                             # type: ignore[return-value]


def block_record(results: list[dict], slots: int, meta: dict, gen: GenerationConfig | None, eos_id: int | None,
                 decode: Callable[[list[int]], str] | None) -> dict:
    """One finished block in Runner._grid's saved shape. Generated ids go through the engine's own StopTracker,
    so EOS and stop strings cut tokens and texts exactly as the engine's rows are cut (greedy: the tokens after
    a stop change nothing before it)."""
    if gen is not None:
        tokens, texts = [], []
        for r in results:
            stops = StopTracker(1, gen, eos_id, decode)
            for t in r["generated"]:
                stops.update([t])
                if stops.all_done:
                    break
            tk, tx, _ = stops.finish()
            tokens.append(tk[0])
            texts.append(tx[0])
        result: Any = {"tokens": tokens, "texts": texts}
    else:
        result = [{"nll": r["nll"], "hit": r["hit"]} for r in results]
    peer = {"system": "kvpress", **{k: meta.get(k) for k in ("kvpress_version", "press_class", "params",
                                                             "attn_implementation", "dtype", "compression")}}
    return {"result": result, "slots": slots, "evicted": any(r["evicted"] for r in results),
            "prefill_seconds": 0.0, "seconds": sum(r["prefill_s"] + r["decode_s"] for r in results), "peer": peer}
