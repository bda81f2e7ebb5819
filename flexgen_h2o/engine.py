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
from flexgen_h2o.kv import EvictionConfig, RowBudgets, get_policy
from flexgen_h2o.kv.cache import KVCache, StagingBuffers
from flexgen_h2o.kv.draws import KeyedDraws
from flexgen_h2o.kv.mixed import SplitKVCache, prompt_layout
from flexgen_h2o.memory import ComputeTier, DiskTier, HostTier, OffloadDir, check_space
from flexgen_h2o.kernels import resolve as resolve_kernels
from flexgen_h2o.models import ModelConfig, build_layers, schedule_groups
from flexgen_h2o.models.layer import ElsewhereLayer
from flexgen_h2o.planner.plan import BatchPlan, Plan
from flexgen_h2o.sampling import Sampler, StopTracker
from flexgen_h2o.schedule.activations import ActivationHome
from flexgen_h2o.schedule.executor import BatchState, BlockExecutor, RunParts
from flexgen_h2o.weights.compressed import compressed_weights
from flexgen_h2o.weights.placement import WeightPlacement
from flexgen_h2o.weights.staging import StagingPool


SAMPLE, END = -1, -2           # `forced` entries: sample this step; finish this sequence here
# summed over blocks; every other metric describes one block (the last)
ADDITIVE_METRICS = ("prefill_s", "decode_s", "prompt_tokens", "generated_tokens", "decode_steps")


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
        self.eviction = self._checked(eviction or EvictionConfig(policy="full"))
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
        self.link = None                # a pipeline stage's StageLink (set by the caller), None in one process
        self.decode = decode
        uses_disk = any(self.offload.tier_fractions(what)[2] > 0 for what in ("cache", "act"))
        self.offload_dir = OffloadDir(offload_dir) if (offload_dir and uses_disk) else None
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
        self.last_caches: list[dict[int, SplitKVCache]] = []     # the last block's caches, for inspection
        self.last_plan: Plan | None = None                       # and its plan (budgets, splits, bytes)
        self._handles: list = []                                 # tier allocations of the current block
        # optional hook (token step, sequence indices, logits (b, V)): tests and per-step timing use it
        self.on_step_logits: Callable[[int, list[int], Tensor], None] | None = None

    # --- allocation on tiers ---

    def _alloc(self, kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """A tensor homed on a tier, charged to that tier's accounting; disk gives a writable memmap view."""
        if kind not in self.tiers:
            raise ConfigError("the placement puts tensors on disk: pass an --offload-dir")
        tier = self.tiers[kind]
        handle = tier.allocate(shape, dtype)
        self._handles.append(handle)
        return tier.torch_view(handle) if kind == "disk" else handle.payload

    def release(self) -> None:
        """Free every tensor the last run allocated on the tiers (disk files are deleted), and drop the last block's
        caches, which would otherwise keep that KV in memory the tiers no longer count."""
        self.backend.synchronize()      # no copy still queued on a lane may read or write what is freed
        self.last_caches = []
        for handle in self._handles:
            handle.free()
        if self.kv_staging is not None:
            self.kv_staging.clear()
        self._handles = []

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

    def _checked(self, eviction: EvictionConfig) -> EvictionConfig:
        if eviction.position_rolling and self.model.positions != "rope":
            raise ConfigError("--position-rolling applies to RoPE models (Llama); OPT keys carry no rotation")
        return eviction

    @staticmethod
    def _draws(ev: EvictionConfig, layer: int, prompts: Sequence[Sequence[int]]) -> KeyedDraws | None:
        """The random rule's draws for one layer's rows, keyed by each prompt's tokens (kv/draws.py)."""
        return KeyedDraws.for_prompts(ev.seed, layer, prompts) if ev.policy == "random" else None

    def _make_cache(self, layer, plan: BatchPlan, budget: RowBudgets, capacity: int, policy,
                    draws: KeyedDraws | None, rolling: bool) -> SplitKVCache:
        """One GPU batch's cache of one layer: every tier's part allocates the block's capacity (its largest
        sequence budget, as the planner counts it) and keeps its own rows' budgets."""
        parts = []
        # attention reads the window on the compute device, or where the KV lives with cpu_cache_compute
        host_attention = (self.offload.cpu_cache_compute and any(kind != "compute" for _, _, kind in plan.cache)
                          and (self.device.type != "cpu" or self.host_attention_on_cpu))
        attention_on = "cpu" if host_attention else self.device.type
        # batch invariance: attention reads the stored rows wherever they were staged from (KVCache.copy_stored)
        reads = dict(read_in_place=self.offload.kv_read_in_place(attention_on, rolling, plan.size),
                     copy_stored=self.kernels.batch_invariant and attention_on == "cpu" and not rolling)
        for lo, hi, kind in plan.cache:
            cache = KVCache(layer.kv_spec(), hi - lo, capacity, policy, budget.part(lo, hi), fmt=self.offload.kv_format,
                            alloc=lambda shape, dtype, kind=kind: self._alloc(kind, shape, dtype), tier_kind=kind,
                            rolling=rolling, generator=None if draws is None else draws.part(lo, hi),
                            staging=self.kv_staging, kernels=self.kernels, **reads)
            parts.append((lo, hi, cache))
        return SplitKVCache(parts, attention_device=torch.device("cpu") if host_attention else None)

    def _async_lanes(self) -> frozenset:
        """Lanes worth a worker thread: on CUDA every copy is a DMA that runs beside the kernels. On a CPU a
        RAM-to-RAM copy or conversion is compute too, and a second thread only steals the cores the layer
        math was using (measured on 2 cores: an H2O decode step 0.52 s with a KV thread, 0.41 s inline), so a
        lane gets a thread only where its reads wait on the disk."""
        if self.backend.is_cuda:
            return frozenset({"weights", "kv"})
        return frozenset(lane for lane, what in (("weights", "weights"), ("kv", "cache"))
                         if self.offload.tier_fractions(what)[2] > 0)

    # --- generation ---

    def prefill(self, prompts: Sequence[Sequence[int]], rolling: bool = False) -> list[Prefilled]:
        """Run the prompts' pass once per block and keep what any eviction rule needs to decode from it
        (generate(prompts, ..., prefilled=...)). The cache keeps every prompt token with its prefill score, so
        the prompt pass is the one an H2O run makes (scored attention: a score-free rule's own run would use
        the fused kernel, equal to fp32 rounding). rolling: keys stored before RoPE, for rolling rules."""
        out = []
        block = self.offload.block_size
        for start in range(0, len(prompts), block):
            chunk = [list(p) for p in prompts[start:start + block]]
            longest = max(len(p) for p in chunk)
            keep_all = self._checked(EvictionConfig(policy="h2o", hh_size=longest, recent_size=longest,
                                                    position_rolling=rolling))
            step0: dict[int, Tensor] = {}
            hook, self.on_step_logits = self.on_step_logits, None       # step 0 is reported by each decode
            try:
                self._generate_block(chunk, list(range(len(chunk))), GenerationConfig(max_new_tokens=1,
                                     stop_at_eos=False), None, None, range(len(chunk)), keep_all, capture=step0)
            finally:
                self.on_step_logits = hook
            gbs = self.offload.gpu_batch_size
            lengths = [torch.tensor([len(p) for p in chunk[lo:lo + gbs]]) for lo in range(0, len(chunk), gbs)]
            layers = [{l: prompt_layout(split.snapshot(), n, longest) for l, split in caches.items()}
                      for caches, n in zip(self.last_caches, lengths)]
            out.append(Prefilled(chunk, rolling, layers, [step0[k] for k in range(len(layers))]))
            self.last_caches = []
            self.release()
        return out

    def generate(self, prompts: Sequence[Sequence[int]], gen: GenerationConfig | None = None,
                 max_new_tokens: Sequence[int] | None = None, forced: Sequence[Sequence[int]] | None = None,
                 seeds: Sequence[int] | None = None, eviction: EvictionConfig | None = None,
                 prefilled: Sequence[Prefilled] | None = None) -> GenerationResult:
        """Generate for token-id prompts; blocks of `block_size` run one after another.

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
        ev = self._checked(eviction) if eviction is not None else self.eviction
        block = self.offload.block_size
        n_blocks = -(-len(prompts) // block)
        if prefilled is not None and (len(prefilled) != n_blocks or any(
                pre.prompts != [list(p) for p in prompts[k * block:(k + 1) * block]]
                for k, pre in enumerate(prefilled))):
            raise ConfigError("prefilled was made for other prompts (or another block size): call "
                              "Engine.prefill(prompts) on these prompts first")
        result = GenerationResult(token_ids=[], texts=[], finish_reasons=[], prompt_lens=[])
        totals: Counter = Counter()
        per_block: dict = {}
        for start in range(0, len(prompts), block):
            chunk = list(range(start, min(len(prompts), start + block)))
            per_seq_max = [max_new_tokens[i] for i in chunk] if max_new_tokens is not None else None
            tokens, texts, reasons, times = self._generate_block(
                [prompts[i] for i in chunk], chunk, gen, per_seq_max,
                [forced[i] for i in chunk] if forced is not None else None,
                [seeds[i] for i in chunk] if seeds is not None else chunk, ev,
                prefilled[start // block] if prefilled is not None else None)
            result.token_ids += tokens
            result.texts += texts
            result.finish_reasons += reasons
            result.prompt_lens += [len(prompts[i]) for i in chunk]
            totals.update({k: times.pop(k) for k in ADDITIVE_METRICS})
            per_block = times                    # block shape and step times: the last block's
        result.metrics = {**per_block, **totals}
        return result

    def generate_refill(self, prompts: Sequence[Sequence[int]], gen: GenerationConfig | None = None,
                        max_new_tokens: Sequence[int] | None = None, seeds: Sequence[int] | None = None,
                        eviction: EvictionConfig | None = None, share: float | None = None,
                        on_tokens: Callable[[int], None] | None = None) -> Iterator:
        """Continuous refill (schedule/refill.py): lists of Finished as prompts finish; then last_refill_metrics."""
        from flexgen_h2o.schedule.refill import RefillRun
        run = RefillRun(self, prompts, gen or GenerationConfig(), max_new_tokens, seeds, eviction, share, on_tokens)
        yield from run.run()
        self.last_refill_metrics = run.metrics

    def _generate_block(self, prompts: list[Sequence[int]], seq_index: list[int], gen: GenerationConfig,
                        per_seq_max: list[int] | None, forced: list[Sequence[int]] | None,
                        seeds: Sequence[int], ev: EvictionConfig, prefilled: Prefilled | None = None,
                        capture: dict | None = None):
        """capture: filled with each GPU batch's step-0 logits (Engine.prefill)."""
        plan, batches = self._prepare_block(prompts, gen, per_seq_max, ev, prefilled, capture is not None)
        return self._run_block(plan, batches, seq_index, gen, per_seq_max, forced, seeds, prefilled, capture)

    def _prepare_block(self, prompts: list[Sequence[int]], gen: GenerationConfig, per_seq_max: list[int] | None,
                       ev: EvictionConfig, prefilled: Prefilled | None,
                       keep_all: bool) -> tuple[Plan, list[BatchState]]:
        """Check the block, plan it, and allocate its GPU batches: padded ids, caches (cut to this rule from a
        kept prefill), activation homes. The previous block's tensors are freed first."""
        if prefilled is not None and prefilled.rolling != ev.position_rolling:
            state = "on" if prefilled.rolling else "off"
            raise ConfigError(f"this prefill stored its keys for position rolling {state}; call "
                              f"Engine.prefill(prompts, rolling={ev.position_rolling}) for this rule")
        if any(len(p) == 0 for p in prompts):
            raise ConfigError("empty prompt: every prompt needs at least one token")
        prompt_len = max(len(p) for p in prompts)
        n_new = max(per_seq_max) if per_seq_max else gen.max_new_tokens
        if self.check_context and prompt_len + n_new > self.model.max_seq_len and not ev.position_rolling:
            raise ConfigError(f"prompt ({prompt_len}) + new tokens ({n_new}) exceed the context window "
                              f"({self.model.max_seq_len}) of {self.model.name}; shorten them or use "
                              "--position-rolling (Llama)")
        # each sequence's budget from its own real prompt length (h2o-port: the block's, as the port does); a
        # prefill kept for later rules keeps every token and still needs the scores, which `full` skips
        plan = Plan.for_block(self.model, self.offload, ev, [len(p) for p in prompts],
                              per_seq_max or [gen.max_new_tokens] * len(prompts), device_type=self.device.type,
                              compute_itemsize=self.compute_dtype.itemsize, keep_all=keep_all)
        budget, policy = plan.budgets, get_policy(plan.policy)
        self.last_plan = plan
        self.release()                 # the previous block's KV goes before this block's is allocated
        pad_id = self.model.pad_id if self.model.pad_id is not None else 0
        ids = torch.full((len(prompts), prompt_len), pad_id, dtype=torch.long)
        valid = torch.zeros(len(prompts), prompt_len, dtype=torch.bool)
        for r, p in enumerate(prompts):
            ids[r, prompt_len - len(p):] = torch.tensor(list(p), dtype=torch.long)
            valid[r, prompt_len - len(p):] = True
        # the transient tensors of one layer forward are real memory too: charge the compute tier an estimate
        self._handles.append(self.tiers["compute"].reserve(plan.layer_workspace(), "workspace (estimated)"))
        if "disk" in self.tiers:                # before the first file: enough room for this block?
            check_space(self.offload_dir.root, plan.disk_bytes())
        batches, mine = [], range(*self.stage)
        for bp in plan.batches:
            lo, hi = bp.lo, bp.hi
            rows = budget.part(lo, hi)
            b = BatchState(list(range(lo, hi)), ids[lo:hi], valid[lo:hi], real_len=valid[lo:hi].sum(1),
                           kept_max=torch.tensor(rows.values("budget")),
                           evicts=None if keep_all else tuple(r.evicts for r in rows.rows))   # a prefill scores all
            b.caches = {l: self._make_cache(layer, bp, rows, plan.capacity, policy,
                                            self._draws(ev, l, prompts[lo:hi]), ev.position_rolling)
                        for l, layer in enumerate(self.layers) if layer.kind == "attn" and l in mine}
            if prefilled is not None:          # this rule's choice of the kept prompt rows, as a prefill makes it
                for l, (k, v, score, pos, *key_scale) in prefilled.layers[len(batches)].items():
                    b.caches[l].commit_prefill(k, v, score if policy.needs_scores else None, pos,
                                               key_scale=key_scale[0] if key_scale else None)
            b.activations = ActivationHome(list(bp.act), self._alloc, self.device)
            batches.append(b)
        return plan, batches

    def _run_block(self, plan: Plan, batches: list[BatchState], seq_index: list[int], gen: GenerationConfig,
                   per_seq_max: list[int] | None, forced: list[Sequence[int]] | None, seeds: Sequence[int],
                   prefilled: Prefilled | None, capture: dict | None):
        """Walk the block through the zig-zag schedule (from step 1 after a kept prefill), sampling and
        tracking stops; return its tokens, texts, finish reasons and metrics."""
        ev, policy, prompt_len, n_new = plan.eviction, get_policy(plan.policy), plan.prompt_len, plan.gen_len
        n_seqs = plan.n_seqs
        sampler = Sampler(gen, seeds)
        stops = StopTracker(n_seqs, gen, self.model.eos_id, self.decode, per_seq_max)

        def on_logits(token: int, batch: int, logits: Tensor) -> None:
            b = batches[batch]
            b.next_ids = sampler(logits, rows=range(b.seq_index[0], b.seq_index[-1] + 1))
            if forced is not None:
                for row, s in enumerate(b.seq_index):
                    entry = forced[s][token] if token < len(forced[s]) else SAMPLE
                    if entry == END:
                        stops.end(s)
                    elif entry >= 0:
                        b.next_ids[row] = int(entry)
            if capture is not None and token == 0:
                capture[batch] = logits.detach().clone()
            if self.on_step_logits is not None:
                self.on_step_logits(token, [seq_index[i] for i in b.seq_index], logits)
            if batch == len(batches) - 1:
                stops.update(torch.cat([x.next_ids for x in batches]).tolist())

        parts = RunParts(backend=self.backend, layers=self.layers, groups=self.groups, weights=self.weights,
                         device=self.device, compute_dtype=self.compute_dtype, needs_scores=policy.needs_scores,
                         rolling=ev.position_rolling, score_reduce=ev.score_reduce,
                         prefill_rows=plan.prefill_rows, async_lanes=self._async_lanes(),
                         prefill_by_rows=plan.prefill_by_rows and self.link is None, kernels=self.kernels,
                         on_logits=on_logits, link=self.link,
                         should_stop=lambda token: stops.all_done or token + 1 >= n_new)
        if self.link is not None:       # the last stage decides when the block stops; the others are told
            parts.should_stop = self.link.stop_rule(batches, parts.should_stop)
        # a pipeline stage with every weight resident may take each batch through its layers in turn, so the next
        # stage starts on the first batch while this one computes the rest (frontends/scale_out.attach_link)
        batch_major = self.link is not None and self.link.batch_major and self.offload.tier_fractions("weights")[0] == 1
        t0 = time.perf_counter()
        if prefilled is None:
            times = BlockExecutor(parts, batches, n_new, self.offload.overlap, batch_major=batch_major).run()
        else:
            for k, logits in enumerate(prefilled.logits):
                on_logits(0, k, logits)
            times = [time.perf_counter()]
            if not parts.should_stop(0):
                times += BlockExecutor(parts, batches, n_new, self.offload.overlap, first_token=1).run()
        if self.link is not None:
            self.link.flush()
        t_end = time.perf_counter()
        self.last_caches = [b.caches for b in batches]
        tokens, texts, reasons = stops.finish()
        n_gen = sum(len(t) for t in tokens)
        metrics = {"prefill_s": times[0] - t0, "decode_s": t_end - times[0], "prompt_tokens": n_seqs * prompt_len,
                   "generated_tokens": n_gen, "decode_steps": len(times) - 1, "block_size": n_seqs,
                   "padded_prompt_len": prompt_len,
                   # wall time of decode step i (i >= 1), which attends prompt_len + i tokens (or the budget)
                   "step_times_s": [b - a for a, b in zip(times, times[1:])]}
        return tokens, texts, reasons, metrics
