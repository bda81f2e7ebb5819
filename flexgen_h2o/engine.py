"""Engine: builds every piece from the configs and generates for a list of token-id prompts, block by block.

A block is gpu_batch_size x num_gpu_batches sequences, left-padded to one prompt length; the BlockExecutor walks
it through the zig-zag schedule. Placement (OffloadPolicy) and eviction (EvictionConfig) are separate inputs.
"""
from __future__ import annotations

import time
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from flexgen_h2o.backend import get_backend
from flexgen_h2o.config import ConfigError, GenerationConfig, GenerationResult, OffloadPolicy
from flexgen_h2o.kv import EvictionConfig, get_policy
from flexgen_h2o.kv.staging import StagingBuffers
from flexgen_h2o.kv.draws import KeyedDraws
from flexgen_h2o.kv.mixed import SplitKVCache, prompt_layout
from flexgen_h2o.memory import ComputeTier, DiskTier, HostTier, OffloadDir
from flexgen_h2o.kernels import resolve as resolve_kernels
from flexgen_h2o.models import ModelConfig, build_layers, schedule_groups
from flexgen_h2o.models.layer import ElsewhereLayer
from flexgen_h2o.planner.job import JobPlan, plan_job
from flexgen_h2o.planner.plan import Plan
from flexgen_h2o.sampling import Sampler, StopTracker
from flexgen_h2o.schedule.block import Runtime
from flexgen_h2o.schedule.executor import BatchState
from flexgen_h2o.schedule.refill import RefillRun
from flexgen_h2o.weights.compressed import compressed_weights
from flexgen_h2o.weights.placement import WeightPlacement
from flexgen_h2o.weights.staging import StagingPool


SAMPLE, END = -1, -2           # `forced` entries: sample this step; finish this sequence here
# summed over blocks; every other metric describes one block (the last)
ADDITIVE_METRICS = ("prefill_s", "decode_s", "prompt_tokens", "generated_tokens", "decode_steps", "kv_bytes_read")


@dataclass
class Prefilled:
    """One block's prompt pass, kept so that many eviction rules can decode from it (Engine.prefill): every
    prompt token's K/V and fp32 prefill score per (GPU batch, attention layer), and the step-0 logits. The
    accuracy harness runs a grid of policies x budgets over the same prompts; without this, every grid point
    would pay for the same prefill again."""
    prompts: list[list[int]]
    rolling: bool                                        # keys were stored before RoPE (position rolling)
    layers: list[dict[int, tuple[Tensor, ...]]]          # per GPU batch: layer -> (k, v, score, pos[, key scale])
    logits: list[Tensor]                                 # per GPU batch: (b, V) logits of step 0
    score_window: int | None = None                      # the prompt queries that scored (EvictionConfig's)


def kv_bytes_read(caches: list[dict[int, SplitKVCache]]) -> Counter:
    """Bytes the decode steps read from these caches, per tier, page selection's summaries apart (KVCache.bytes_read)."""
    read: Counter = Counter()
    for per_layer in caches:
        for split in per_layer.values():
            for cache in split.caches:
                read.update(cache.bytes_read)
    return read


class Engine:
    # tests: take cpu_cache_compute's host-attention path (fp32 windows staged where the KV lives) on a CPU too,
    # where the compute device already is the host and the flag is refused by the CLI
    host_attention_on_cpu: bool = False

    def __init__(self, model: ModelConfig, read_weight: Callable[[str], np.ndarray], *,
                 offload: OffloadPolicy | None = None, eviction: EvictionConfig | None = None,
                 device: str | None = None, offload_dir: str | None = None,
                 decode: Callable[[list[int]], str] | None = None, locate: Callable | None = None,
                 check_context: bool = True, compute_dtype: torch.dtype | None = None,
                 stage: tuple[int, int] | None = None):
        """read_weight: name -> fp16 array; locate: a store's name -> (file, offset, bytes), so disk-homed
        weights are streamed with plain reads instead of through a memmap. eviction: the default KV rule
        (generate can take another per call). check_context=False lets a run go past the model's context
        window without position rolling (the accuracy harness measures exactly that collapse). compute_dtype:
        CUDA's, fp16 unless given (the CPU computes in fp32). stage: a pipeline stage's [lo, hi) range of the
        flat layer list: only its weights are placed and only its caches made (distributed/pipeline.py)."""
        self.model = model
        self.offload = (offload or OffloadPolicy()).validate()
        self.eviction = self.checked(eviction or EvictionConfig(policy="full"))
        self.check_context = check_context
        self.backend = get_backend(device, compute_dtype)
        self.device, self.compute_dtype = self.backend.compute_device, self.backend.compute_dtype
        self.kv_dtype = self.offload.kv_format.dtype
        # CPU: staged KV windows reuse buffers (CUDA's caching allocator already recycles device memory)
        self.kv_staging = None if self.backend.is_cuda else StagingBuffers()
        # the compiled kernels, loaded (or built) here, not in a timed pass, and their switches read once. On CUDA
        # only a host- or disk-homed cache uses them, to commit its decode steps from a copy lane (a fresh GPU
        # machine built them there, the lane held for the whole build)
        self.kernels = resolve_kernels(load=not self.backend.is_cuda or self.offload.tier_fractions("cache")[0] < 1)
        self.layers = build_layers(model)
        lo, hi = self.stage = stage or (0, len(self.layers))
        self.groups = [g for g in schedule_groups([layer.kind for layer in self.layers], self.offload.sep_layer)
                       if lo <= g[0] and g[-1] < hi]
        own = [layer if lo <= i < hi else ElsewhereLayer(layer.kind) for i, layer in enumerate(self.layers)]
        self.decode = decode
        self.offload_dir = OffloadDir(offload_dir) if (offload_dir and self.offload.uses_disk) else None
        self.tiers = {"compute": ComputeTier(self.backend, self.offload.compute_budget_bytes),
                      "host": HostTier(self.backend, pin=self.backend.is_cuda)}
        if self.offload_dir is not None:
            self.tiers["disk"] = DiskTier(self.offload_dir.__enter__())
        if self.offload.weight_bits:     # the packed matrices, from the store's compressed copy (made once)
            read_weight, locate, _ = compressed_weights(own, read_weight, locate, self.offload.weight_format)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)     # read-only memmaps are never written through
            self.weights = WeightPlacement(own, read_weight, self.offload.tier_fractions("weights"),
                                           device=self.device, compute_dtype=self.compute_dtype,
                                           pin=self.backend.pin, pin_weight=self.offload.pin_weight, locate=locate,
                                           pool=StagingPool(self.tiers["compute"], reuse=not self.backend.is_cuda),
                                           uncached_disk=self.offload.uncached_disk_weights,
                                           tiers=self.tiers, fmt=self.offload.weight_format)
        self.runtime = Runtime(self.backend, self.layers, self.groups, self.stage, self.weights, self.kernels,
                               self.offload, self.tiers, offload_root=self.offload_dir and self.offload_dir.root,
                               kv_staging=self.kv_staging, host_attention_on_cpu=self.host_attention_on_cpu)
        self.last_caches: list[dict[int, SplitKVCache]] = []     # the last block's caches, for inspection
        self.last_plan: Plan | None = None                       # and its plan (budgets, splits, bytes)
        # optional hook (token step, sequence indices, logits (b, V)): tests and per-step timing use it
        self.on_step_logits: Callable[[int, list[int], Tensor], None] | None = None

    @property
    def link(self):
        """A pipeline stage's StageLink (set by frontends/scale_out.attach_link), None in one process."""
        return self.runtime.link

    @link.setter
    def link(self, link) -> None:
        self.runtime.link = link

    def release(self) -> None:
        """Free every tensor the last run allocated on the tiers (disk files are deleted), and drop the last block's
        caches, which would otherwise keep that KV in memory the tiers no longer count."""
        self.last_caches = []
        self.runtime.release()

    def close(self) -> None:
        """Free tier allocations and staging buffers, and remove this run's offload folder."""
        self.release()
        self.weights.close()
        if self.offload_dir is not None:
            self.tiers.pop("disk").close()
            self.offload_dir.__exit__(None, None, None)
            self.offload_dir = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def checked(self, eviction: EvictionConfig) -> EvictionConfig:
        if eviction.position_rolling and self.model.positions != "rope":
            raise ConfigError("--position-rolling applies to RoPE models (Llama); OPT keys carry no rotation")
        return eviction

    def plan(self, prompts: Sequence[Sequence[int]], max_new: Sequence[int], eviction: EvictionConfig | None = None,
             **kw) -> JobPlan:
        """This engine's plan of a job (planner/job.plan_job): prompts checked, budgets, blocks in the given order
        unless kw says bucket=True; kw: plan_job's label, bucket, refill, keep_all."""
        ev = self.checked(eviction) if eviction is not None else self.eviction
        kw.setdefault("bucket", False)
        return plan_job(self.model, self.offload, ev, [len(p) for p in prompts], list(max_new),
                        device_type=self.device.type, compute_itemsize=self.compute_dtype.itemsize,
                        check_window=self.check_context, **kw)

    # --- generation ---

    def prefill(self, prompts: Sequence[Sequence[int]], rolling: bool = False,
                score_window: int | None = None) -> list[Prefilled]:
        """Run the prompts' pass once per block and keep what any eviction rule needs to decode from it
        (generate(prompts, ..., prefilled=...)). The cache keeps every prompt token with its prefill score, so
        the prompt pass is the one an H2O run makes (scored attention: a score-free rule's own run would use
        the fused kernel, equal to fp32 rounding). rolling: keys stored before RoPE, for rolling rules;
        score_window: the scores from the prompts' last queries only, for rules with that score_window."""
        out = []
        block = self.offload.block_size
        for start in range(0, len(prompts), block):
            chunk = [list(p) for p in prompts[start:start + block]]
            longest = max(len(p) for p in chunk)
            keep_all = EvictionConfig(policy="h2o", hh_size=longest, recent_size=longest, position_rolling=rolling,
                                      score_window=score_window)
            job = self.plan(chunk, [1] * len(chunk), keep_all, keep_all=True)
            step0: dict[int, Tensor] = {}
            hook, self.on_step_logits = self.on_step_logits, None       # step 0 is reported by each decode
            try:
                self.generate_block(job, 0, chunk, GenerationConfig(max_new_tokens=1, stop_at_eos=False),
                                    range(len(chunk)), capture=step0)
            finally:
                self.on_step_logits = hook
            gbs = self.offload.gpu_batch_size
            lengths = [torch.tensor([len(p) for p in chunk[lo:lo + gbs]]) for lo in range(0, len(chunk), gbs)]
            layers = [{l: prompt_layout(split.snapshot(), n, longest) for l, split in caches.items()}
                      for caches, n in zip(self.last_caches, lengths)]
            out.append(Prefilled(chunk, rolling, layers, [step0[k] for k in range(len(layers))], score_window))
            self.release()
        return out

    def generate(self, prompts: Sequence[Sequence[int]], gen: GenerationConfig | None = None,
                 max_new_tokens: Sequence[int] | None = None, forced: Sequence[Sequence[int]] | None = None,
                 seeds: Sequence[int] | None = None, eviction: EvictionConfig | None = None,
                 prefilled: Sequence[Prefilled] | None = None) -> GenerationResult:
        """Generate for token-id prompts; blocks of `block_size` run one after another, in the given order.

        forced (teacher forcing, for evaluation and streaming): per prompt, the tokens fed back at steps 0, 1,
        ... instead of the sampled ones; SAMPLE (or the end of the list) means "sample here", END finishes that
        sequence. Eviction runs exactly as in free generation. The logits of step t (see `on_step_logits`)
        predict forced[s][t]. Entry t is read only at step t, after the hook saw step t - 1, so a scripted
        stream can decide what comes next from what was generated.

        seeds: per prompt, the key its sampling generator is seeded from (with gen.seed); default its index
        here. Callers that reorder prompts (bucketing, resume) pass a stable key, so a prompt samples the same
        tokens wherever it runs. eviction: this call's KV rule (default: the engine's); weights stay placed.
        prefilled: Engine.prefill(prompts)'s result: no prompt pass runs; each block's cache is cut to this
        call's rule from the kept prefill (the same selection a normal run makes) and decoding starts at step 1."""
        if forced is not None and len(forced) != len(prompts):
            raise ConfigError(f"forced has {len(forced)} continuations for {len(prompts)} prompts")
        if seeds is not None and len(seeds) != len(prompts):
            raise ConfigError(f"seeds has {len(seeds)} entries for {len(prompts)} prompts")
        gen = (gen or GenerationConfig()).validate()
        job = self.plan(prompts, max_new_tokens or [gen.max_new_tokens] * len(prompts), eviction)
        if prefilled is not None and (len(prefilled) != len(job.blocks) or any(
                pre.prompts != [list(prompts[i]) for i in block] for pre, block in zip(prefilled, job.blocks))):
            raise ConfigError("prefilled was made for other prompts (or another block size): call "
                              "Engine.prefill(prompts) on these prompts first")
        result = GenerationResult(token_ids=[], texts=[], finish_reasons=[], prompt_lens=[])
        totals: Counter = Counter()
        per_block: dict = {}
        for k, block in enumerate(job.blocks):
            tokens, texts, reasons, times = self.generate_block(
                job, k, [prompts[i] for i in block], gen, [seeds[i] for i in block] if seeds is not None else block,
                forced=[forced[i] for i in block] if forced is not None else None,
                prefilled=prefilled[k] if prefilled is not None else None)
            result.token_ids += tokens
            result.texts += texts
            result.finish_reasons += reasons
            result.prompt_lens += [len(prompts[i]) for i in block]
            totals.update({key: times.pop(key) for key in ADDITIVE_METRICS})
            per_block = times                    # block shape and step times: the last block's
        result.metrics = {**per_block, **totals}
        return result

    def generate_refill(self, prompts: Sequence[Sequence[int]], gen: GenerationConfig | None = None,
                        max_new_tokens: Sequence[int] | None = None, seeds: Sequence[int] | None = None,
                        eviction: EvictionConfig | None = None, share: float | None = None,
                        on_tokens: Callable[[int], None] | None = None, job: JobPlan | None = None) -> Iterator:
        """Continuous refill (schedule/refill.py): lists of Finished as prompts finish; then last_refill_metrics.
        job: these prompts' refilled plan (plan(..., refill=True)), in join order; made here when not given."""
        gen = (gen or GenerationConfig()).validate()
        if seeds is not None and len(seeds) != len(prompts):
            raise ConfigError(f"seeds has {len(seeds)} entries for {len(prompts)} prompts")
        job = job or self.plan(prompts, max_new_tokens or [gen.max_new_tokens] * len(prompts), eviction,
                               refill=True)
        run = RefillRun(self.runtime, job, prompts, gen, seeds, self.model, self.decode, share, on_tokens,
                        hook=lambda: self.on_step_logits)
        self.last_plan = job.plans[0] if job.plans else None
        yield from run.run()
        self.last_caches = run.caches()
        self.last_refill_metrics = run.metrics

    def generate_block(self, job: JobPlan, k: int, prompts: list[Sequence[int]], gen: GenerationConfig,
                       seeds: Sequence[int], forced: list[Sequence[int]] | None = None,
                       prefilled: Prefilled | None = None, capture: dict | None = None) -> tuple:
        """Block k of `job` (its `prompts`, in block order): allocate from its Plan, walk it through the zig-zag
        schedule (from step 1 after a kept prefill), sample and track stops; return its tokens, texts, finish
        reasons and metrics. capture: filled with each GPU batch's step-0 logits (Engine.prefill)."""
        plan, batches = self._allocate(job, k, prompts, prefilled)
        per_seq_max = [job.max_new[i] for i in job.blocks[k]]
        n_new = plan.gen_len
        sampler = Sampler(gen, seeds)
        stops = StopTracker(plan.n_seqs, gen, self.model.eos_id, self.decode, per_seq_max)
        seq_index = list(job.blocks[k])

        def entries(token: int, batch: int) -> list[int]:      # each row's forced entry, read once per step
            return [forced[s][token] if token < len(forced[s]) else SAMPLE for s in batches[batch].seq_index]

        def took(batch: int, row_entries: list[int] | None) -> None:    # the batch's next ids are chosen
            for s, entry in zip(batches[batch].seq_index, row_entries or ()):
                if entry == END:
                    stops.end(s)
            if batch == len(batches) - 1:
                stops.update(torch.cat([x.next_ids for x in batches]).tolist())

        def on_logits(token: int, batch: int, logits: Tensor) -> None:
            b = batches[batch]
            b.next_ids = sampler(logits, rows=range(b.seq_index[0], b.seq_index[-1] + 1))
            row_entries = entries(token, batch) if forced is not None else None
            for row, entry in enumerate(row_entries or ()):
                if entry >= 0:
                    b.next_ids[row] = int(entry)
            if capture is not None and token == 0:
                capture[batch] = logits.detach().clone()
            if self.on_step_logits is not None:
                self.on_step_logits(token, [seq_index[i] for i in b.seq_index], logits)
            took(batch, row_entries)

        def on_ids(token: int, batch: int, ids: Tensor) -> None:      # a pipeline stage without the head
            batches[batch].next_ids = ids
            took(batch, entries(token, batch) if forced is not None else None)

        def should_stop(token: int) -> bool:
            return stops.all_done or token + 1 >= n_new

        t0 = time.perf_counter()
        run = dict(on_logits=on_logits, on_ids=on_ids, should_stop=should_stop)
        if prefilled is None:
            times = self.runtime.run(plan, batches, n_new, **run)
        else:
            for b, logits in enumerate(prefilled.logits):
                on_logits(0, b, logits)
            times = [time.perf_counter()]
            if not should_stop(0):
                times += self.runtime.run(plan, batches, n_new, first_token=1, **run)
        t_end = time.perf_counter()
        self.last_caches = [b.caches for b in batches]
        tokens, texts, reasons = stops.finish()
        n_gen = sum(len(t) for t in tokens)
        metrics = {"prefill_s": times[0] - t0, "decode_s": t_end - times[0], "prompt_tokens": plan.n_seqs *
                   plan.prompt_len, "generated_tokens": n_gen, "decode_steps": len(times) - 1, "block_size": plan.n_seqs,
                   "padded_prompt_len": plan.prompt_len, "kv_bytes_read": kv_bytes_read(self.last_caches).total(),
                   # wall time of decode step i (i >= 1), which attends prompt_len + i tokens (or the budget)
                   "step_times_s": [b - a for a, b in zip(times, times[1:])]}
        return tokens, texts, reasons, metrics

    def _allocate(self, job: JobPlan, k: int, prompts: list[Sequence[int]],
                  prefilled: Prefilled | None) -> tuple[Plan, list[BatchState]]:
        """Block k's GPU batches allocated from its plan: padded ids, caches (cut to this rule from a kept
        prefill), activation homes. The previous block's tensors are freed first."""
        plan, ev = job.plans[k], job.eviction
        if prefilled is not None and prefilled.rolling != ev.position_rolling:
            state = "on" if prefilled.rolling else "off"
            raise ConfigError(f"this prefill stored its keys for position rolling {state}; call "
                              f"Engine.prefill(prompts, rolling={ev.position_rolling}) for this rule")
        if prefilled is not None and ev.needs_scores and prefilled.score_window != ev.score_window:
            raise ConfigError(f"this prefill scored its prompts with score_window {prefilled.score_window}; call "
                              f"Engine.prefill(prompts, score_window={ev.score_window}) for this rule")
        self.last_plan = plan
        self.last_caches = []
        prompt_len = plan.prompt_len
        pad_id = self.model.pad_id if self.model.pad_id is not None else 0
        ids = torch.full((len(prompts), prompt_len), pad_id, dtype=torch.long)
        valid = torch.zeros(len(prompts), prompt_len, dtype=torch.bool)
        for r, p in enumerate(prompts):
            ids[r, prompt_len - len(p):] = torch.tensor(list(p), dtype=torch.long)
            valid[r, prompt_len - len(p):] = True
        random = ev.policy == "random"     # its draws keyed by each prompt's tokens (kv/draws.py)
        batches = self.runtime.allocate(
            plan, ids, valid, lambda l, lo, hi: KeyedDraws.for_prompts(ev.seed, l, prompts[lo:hi]) if random else None,
            evicts=None if job.keep_all else [b.evicts for b in plan.budgets.rows])   # a prefill scores every row
        if prefilled is not None:          # this rule's choice of the kept prompt rows, as a prefill makes it
            policy = get_policy(plan.policy)
            for b, kept in zip(batches, prefilled.layers):
                for l, (key, value, score, pos, *key_scale) in kept.items():
                    b.caches[l].commit_prefill(key, value, score if policy.needs_scores else None, pos,
                                               key_scale=key_scale[0] if key_scale else None)
        return plan, batches
