"""The Python API: `LLM(model, ...).generate(prompts, ...)`, shaped like vLLM's `LLM` and HF's `generate`.

    from flexgen_h2o import LLM, OffloadPolicy, EvictionConfig
    llm = LLM("smollm2-135m", offload=OffloadPolicy(gpu_batch_size=8),
              eviction=EvictionConfig(policy="h2o", hh_ratio=0.1))
    for out in llm.chat(["Why is the sky blue?"], max_new_tokens=64):
        print(out.text, out.finish_reason)

Two kinds of policy, two names: `offload` (OffloadPolicy: where weights, KV and activations live, batch sizes)
and `eviction` (EvictionConfig: which KV entries are kept). Prompts go through the same bucketing and block
loop as the CLI's batch mode (schedule/blocks.py), so the API and `python -m flexgen_h2o.run --input` give the
same tokens for the same prompts, seed and policies.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

from flexgen_h2o.backend import get_backend
from flexgen_h2o.config import ConfigError, GenerationConfig, OffloadPolicy
from flexgen_h2o.engine import Engine
from flexgen_h2o.formats import WEIGHT_FORMAT
from flexgen_h2o.kv import EvictionConfig
from flexgen_h2o.loader import load_model
from flexgen_h2o.models import resolve_model
from flexgen_h2o.planner import PARTS, preflight as run_preflight
from flexgen_h2o.planner.job import JobPlan
from flexgen_h2o.schedule.blocks import (BlockResult, add_metrics, encode_prompts, refill_totals, run_blocks,
                                         run_refill)
from flexgen_h2o.weights import WeightStoreError, default_store_path

DEFAULT_OFFLOAD_DIR = "~/flexgen_offload_dir"


@dataclass
class Completion:
    """The result for one prompt (vLLM's RequestOutput, flattened to its single completion)."""
    index: int                           # position of the prompt in the list given to generate()
    prompt: str | None                   # the text prompt (None when token ids were given)
    prompt_token_ids: list[int]          # what the model saw (after the chat template, if any)
    text: str                            # the generation, stop string and EOS removed
    token_ids: list[int]                 # generated ids (EOS included when it ended the sequence)
    finish_reason: str                   # "eos", "stop" (a stop string) or "length" (max_new_tokens)

    def __str__(self) -> str:
        return self.text


def _offload(value: OffloadPolicy | Mapping | None) -> OffloadPolicy:
    if value is None:
        return OffloadPolicy()
    if isinstance(value, Mapping):
        value = OffloadPolicy.from_percent(value["percent"], **{k: v for k, v in value.items() if k != "percent"}) \
            if "percent" in value else OffloadPolicy(**value)
    if not isinstance(value, OffloadPolicy):
        raise ConfigError(f"offload must be an OffloadPolicy or a dict of its fields, got {type(value).__name__}")
    return value.validate()


def _eviction(value: EvictionConfig | Mapping | None) -> EvictionConfig:
    if value is None:
        return EvictionConfig(policy="full")
    if isinstance(value, Mapping):
        value = EvictionConfig(**{"policy": "h2o", **value})
    if not isinstance(value, EvictionConfig):
        raise ConfigError(f"eviction must be an EvictionConfig or a dict of its fields, got {type(value).__name__}")
    return value


class LLM:
    """A model ready to generate, with its placement and KV eviction fixed at construction.

    Args:
        model: a preset (`"smollm2-135m"`, `"opt-30b"`, ...), its HF id, or a local HF checkpoint folder.
        path: the converted weight store (default `~/.cache/flexgen_h2o/<model>` or `$FLEXGEN_H2O_HOME`).
        dummy_weights: deterministic random weights of the right shapes (timings valid, text not).
        offload: placement and batching (`OffloadPolicy`, or a dict of its fields; `{"percent": [...]}` takes
            FlexGen's six numbers). Default: everything on the compute device, GPU batches of 4.
        eviction: the KV rule (`EvictionConfig`, or a dict of its fields with policy "h2o" by default, e.g.
            `{"hh_ratio": 0.1}`). Default: a full cache.
        device: "cuda", "cuda:N" or "cpu" (default: CUDA when present).
        offload_dir: root of the disk tier's files when the placement uses disk.
        preflight: refuse (PreflightError) weights, and later batches, that would not fit this machine.
        progress: tqdm bars for conversion, prefill and decode.
        refill: continuous refill (default): one block of rows for the whole call, a finished row taking the next
            prompt; False runs FlexGen's synchronous blocks (each waits for its longest answer). refill_share:
            the share of free rows that calls a join pass (default: one row with resident weights, a quarter
            when they stream in; schedule/refill.py).
    """

    def __init__(self, model: str = "smollm2-135m", *, path: str | None = None, dummy_weights: bool = False,
                 offload: OffloadPolicy | Mapping | None = None, eviction: EvictionConfig | Mapping | None = None,
                 device: str | None = None, offload_dir: str | None = None, preflight: bool = True,
                 progress: bool = False, refill: bool = True, refill_share: float | None = None):

        offload, eviction = _offload(offload), _eviction(eviction)
        cfg = resolve_model(model)
        on_disk = offload.weights_on_disk
        if preflight:       # the weights alone, before anything is read; batches are checked in generate()
            store = path or default_store_path(cfg.name + "-dummy")
            pending = dummy_weights and on_disk and not os.path.isfile(os.path.join(store, "manifest.json"))
            run_preflight(cfg, offload, EvictionConfig(), prompt_len=1, gen_len=1, backend=get_backend(device),
                          store_dir=store if pending else None, parts=("weights",),
                          dummy_store_bytes=WEIGHT_FORMAT.nbytes(cfg.n_params()) if pending else 0)
        try:
            loaded = load_model(model, path=path, dummy_weights=dummy_weights, dummy_on_disk=on_disk,
                                progress=progress)
        except WeightStoreError as e:      # not converted and not downloadable, or a broken store
            raise ConfigError(str(e)) from None
        self._setup(loaded, offload, eviction, device, offload_dir, preflight, progress, refill, refill_share)

    @classmethod
    def from_loaded(cls, loaded: Any, *, offload: OffloadPolicy | None = None, eviction: EvictionConfig | None = None,
                    device: str | None = None, offload_dir: str | None = None, preflight: bool = True,
                    progress: bool = False, refill: bool = True, refill_share: float | None = None,
                    stage: tuple[int, int] | None = None) -> "LLM":
        """Build around an already loaded model (`loader.load_model`); the CLI uses it after its own preflight.
        stage: a pipeline stage's range of the flat layer list (Engine)."""
        self = cls.__new__(cls)
        self._setup(loaded, _offload(offload), _eviction(eviction), device, offload_dir, preflight, progress, refill,
                    refill_share, stage)
        return self

    def _setup(self, loaded: Any, offload: OffloadPolicy, eviction: EvictionConfig, device: str | None,
               offload_dir: str | None, preflight: bool, progress: bool, refill: bool,
               refill_share: float | None, stage: tuple[int, int] | None = None) -> None:
        if refill_share is not None and not 0 <= refill_share <= 1:
            raise ConfigError(f"refill_share must be in [0, 1], got {refill_share}")
        self.loaded, self.config, self.tokenizer = loaded, loaded.config, loaded.tokenizer
        self.offload, self.eviction = offload, eviction
        self.refill, self.refill_share = refill, refill_share
        self.preflight, self.progress = preflight, progress
        self.offload_dir = os.path.expanduser(offload_dir or DEFAULT_OFFLOAD_DIR)
        decode = (lambda ids: loaded.tokenizer.decode(ids, skip_special_tokens=True)) if loaded.tokenizer else None
        self.engine = Engine(loaded.config, loaded.read, offload=offload, eviction=eviction, device=device,
                             offload_dir=self.offload_dir, decode=decode, locate=loaded.locate, stage=stage)
        self.last_metrics: dict = {}

    # --- generation ---

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 max_new_tokens: int | Sequence[int] = 128, *, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int = 0, stop: str | Sequence[str] | None = None, stop_at_eos: bool = True,
                 generation_config: GenerationConfig | None = None, progress: bool | None = None) -> list[Completion]:
        """Generate for text prompts (used as given, no chat template) or token-id lists.

        max_new_tokens: one budget for all, or one per prompt. temperature 0 is greedy; top_p / top_k filter
        the sampled distribution; `seed` makes sampling repeatable. stop: strings that end a generation (cut
        from its text). generation_config overrides all of these. Returns one Completion per prompt, in order.
        """
        return self._run(prompts, False, max_new_tokens, temperature, top_p, top_k, seed, stop, stop_at_eos,
                         generation_config, progress)

    def chat(self, prompts: str | Sequence[str], max_new_tokens: int | Sequence[int] = 128,
             **kw: Any) -> list[Completion]:
        """Like generate(), with each prompt sent as one user turn through the tokenizer's chat template."""
        return self._run(prompts, True, max_new_tokens, kw.pop("temperature", 0.0), kw.pop("top_p", 1.0),
                         kw.pop("top_k", 0), kw.pop("seed", 0), kw.pop("stop", None), kw.pop("stop_at_eos", True),
                         kw.pop("generation_config", None), kw.pop("progress", None), **kw)

    def _run(self, prompts, chat, max_new_tokens, temperature, top_p, top_k, seed, stop, stop_at_eos,
             generation_config, progress, **unknown) -> list[Completion]:
        if unknown:
            raise TypeError(f"unexpected argument(s): {', '.join(unknown)}")
        if isinstance(prompts, str):
            prompts = [prompts]
        texts, ids = self.tokenize(prompts, chat=chat)
        gen = generation_config or GenerationConfig(
            max_new_tokens=max_new_tokens if isinstance(max_new_tokens, int) else max(max_new_tokens),
            temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
            stop=(stop,) if isinstance(stop, str) else tuple(stop or ()), stop_at_eos=stop_at_eos)
        gen = gen.validate()
        max_new = [gen.max_new_tokens] * len(ids) if isinstance(max_new_tokens, int) or generation_config \
            else [int(n) for n in max_new_tokens]
        if len(max_new) != len(ids):
            raise ConfigError(f"max_new_tokens has {len(max_new)} entries for {len(ids)} prompts")
        out: list[Completion | None] = [None] * len(ids)
        for block in self.generate_blocks(ids, gen, max_new, progress=progress):
            for i, toks, text, reason in zip(block.indices, block.token_ids, block.texts, block.finish_reasons):
                out[i] = Completion(i, texts[i], ids[i], text, toks, reason)
        return out  # type: ignore[return-value]

    def tokenize(self, prompts: Sequence[str] | Sequence[Sequence[int]], *, chat: bool = False
                 ) -> tuple[list[str | None], list[list[int]]]:
        """(texts, token ids) of text prompts or of token-id lists (texts None)."""
        if all(isinstance(p, str) for p in prompts):
            return list(prompts), encode_prompts(self.tokenizer, prompts, chat=chat)
        if chat or not all(isinstance(p, Sequence) and all(isinstance(t, int) for t in p) for p in prompts):
            raise ConfigError("prompts must all be strings, or all be lists of token ids (chat takes strings)")
        return [None] * len(prompts), [list(p) for p in prompts]

    def generate_blocks(self, ids: Sequence[Sequence[int]], gen: GenerationConfig, max_new: Sequence[int], *,
                        progress: bool | None = None, label=lambda i: f"prompt {i}",
                        bucket: bool = True, seeds: Sequence[int] | None = None,
                        job: JobPlan | None = None) -> Iterator[BlockResult]:
        """The block loop behind generate(): the job's plan, the preflight, then results as they finish: one per
        block, or with refill, per group of prompts that finished together (prompts join in the given order).
        job: these prompts' plan (LLM.plan, the CLI's), made here when not given; nothing checks them again.
        Metrics of the whole call land in `last_metrics` once the iterator is exhausted."""
        if job is None:
            job = self.plan(ids, max_new, label=label, bucket=bucket)
        if self.preflight and job.peak is not None:   # KV, activations, workspace of the largest block
            run_preflight(self.config, self.offload, self.eviction, plan=job.peak, backend=self.engine.backend,
                          offload_root=self.offload_dir, parts=tuple(p for p in PARTS if p != "weights"))
        show = self.progress if progress is None else progress
        if job.refill and job.lens:
            yield from run_refill(self.engine, ids, gen, job, progress=show, seeds=seeds, share=self.refill_share)
            self.last_metrics = dict(refill_totals(self.engine.last_refill_metrics, job.lens, job.blocks[0]))
            return
        total: Counter = Counter()
        for res in run_blocks(self.engine, ids, gen, job, progress=show, seeds=seeds):
            add_metrics(total, res, job.lens)
            yield res
        self.last_metrics = dict(total)

    def plan(self, ids: Sequence[Sequence[int]], max_new: Sequence[int], *, label=lambda i: f"prompt {i}",
             bucket: bool = True) -> JobPlan:
        """The job's plan (planner/job.plan_job): every prompt checked against the context window and its budget,
        blocks cut (bucketed by length unless bucket=False), one continuously refilled block with refill."""
        return self.engine.plan(ids, max_new, label=label, bucket=bucket, refill=self.refill)

    # --- lifetime ---

    def close(self) -> None:
        """Free tier memory and remove this run's offload folder. The LLM cannot generate afterwards."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
            self.engine = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"LLM({self.config.name!r}, percent={list(self.offload.percent)}, "
                f"block={self.offload.block_size}, eviction={self.eviction.describe_request()})")
