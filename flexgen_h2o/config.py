"""Run configuration: where tensors live (OffloadPolicy) and how to generate (GenerationConfig).

Two kinds of policy are kept apart by name: OffloadPolicy is FlexGen's placement; the KV eviction rule is
flexgen_h2o.kv.EvictionConfig. Percent fields are 0..100 of the named thing; disk takes what is left.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Sequence


def split_by_fraction(n: int, fractions: tuple[float, float, float]) -> list[tuple[int, int, str]]:
    """Split n sequences into contiguous (lo, hi, tier) ranges: compute first, then host, then disk. Halves
    round up, and a split with no disk share never puts a sequence on disk (1 sequence at 50/50 stays on the
    compute tier, where Python's round(0.5) == 0 would have sent it to disk)."""
    compute, host, disk = fractions
    n_compute = min(n, math.floor(n * compute + 0.5))
    n_host = n - n_compute if disk <= 0 else min(n - n_compute, math.floor(n * host + 0.5))
    bounds = [(0, n_compute, "compute"), (n_compute, n_compute + n_host, "host"), (n_compute + n_host, n, "disk")]
    return [(lo, hi, kind) for lo, hi, kind in bounds if hi > lo]


PREFILL_TOKENS = 4096     # default prompt tokens per prefill forward: GEMMs this tall already run at full rate
# on a GPU each chunk's few hundred small kernels, and the H2O commit's host sync, leave the device idle between
# small chunks (`python -m benchmarks.studies.profile_decode --device cuda --phase prefill` shows it per chunk)
PREFILL_TOKENS_GPU = 16384


class ConfigError(ValueError):
    """Bad user configuration; the message says what was wrong and what to do."""


PERCENT_FIELDS = ("weights_gpu_pct", "weights_cpu_pct", "cache_gpu_pct", "cache_cpu_pct", "act_gpu_pct",
                  "act_cpu_pct")


@dataclass(frozen=True)
class OffloadPolicy:
    gpu_batch_size: int = 4            # sequences per GPU batch
    num_gpu_batches: int = 1           # GPU batches per block; block = gpu_batch_size * num_gpu_batches
    weights_gpu_pct: float = 100.0     # % of each layer's weight bytes on the compute device
    weights_cpu_pct: float = 0.0       # % in host memory; disk takes the rest
    cache_gpu_pct: float = 100.0       # % of the sequences whose KV lives on the compute device
    cache_cpu_pct: float = 0.0
    act_gpu_pct: float = 100.0         # % of the sequences whose hidden states rest on the compute device
    act_cpu_pct: float = 0.0
    overlap: bool = True               # prefetch / write back on copy threads or streams while computing
    pin_weight: bool = True            # pin host-resident weights (CUDA only; ignored on CPU)
    cpu_cache_compute: bool = False    # decode attention runs where the KV lives (host), not on the device
    sep_layer: bool = True             # attention and MLP are separate schedule layers
    kv_dtype: str = "float16"          # KV storage dtype; "float32" gives bit-faithful fp32 runs for tests
    prefill_batch_size: int | None = None     # sequences per prefill forward (None: PREFILL_TOKENS' worth)
    uncached_disk_weights: bool = False  # drop disk weights from the page cache after each read (model > RAM)
    compute_budget_bytes: int | None = None   # capacity of the compute tier (on CPU: a budgeted pool)
    kv_bits: int | None = None         # --compress-cache: KV stored as group-wise int4/int8 (None: kv_dtype)
    weight_bits: int | None = None     # --compress-weight: matrices stored as group-wise int4/int8 (None: fp16)
    group_size: int = 64               # values per quantization group (FlexGen's default)

    @classmethod
    def from_percent(cls, percent: Sequence[float], **kw) -> "OffloadPolicy":
        """FlexGen's six-int `--percent w_gpu w_cpu cache_gpu cache_cpu act_gpu act_cpu`."""
        if len(percent) != 6:
            raise ConfigError(f"--percent takes 6 numbers (w_gpu w_cpu cache_gpu cache_cpu act_gpu act_cpu), "
                              f"got {len(percent)}")
        return cls(**dict(zip(PERCENT_FIELDS, (float(p) for p in percent))), **kw)

    def with_percent(self, percent: Sequence[float]) -> "OffloadPolicy":
        """This policy with another placement; every other field (batch, prefill rows, KV dtype, ...) kept."""
        return self.replace(**dict(zip(PERCENT_FIELDS, (float(p) for p in percent))))

    @property
    def block_size(self) -> int:
        return self.gpu_batch_size * self.num_gpu_batches

    @property
    def percent(self) -> tuple[float, ...]:
        return (self.weights_gpu_pct, self.weights_cpu_pct, self.cache_gpu_pct, self.cache_cpu_pct,
                self.act_gpu_pct, self.act_cpu_pct)

    @property
    def uses_disk(self) -> bool:
        """Whether KV or resting activations get files in the offload folder."""
        return any(self.tier_fractions(what)[2] > 0 for what in ("cache", "act"))

    @property
    def weights_on_disk(self) -> bool:
        """Whether some weights are homed on disk (streamed from the store at every pass)."""
        return self.tier_fractions("weights")[2] > 0

    def tier_fractions(self, what: str) -> tuple[float, float, float]:
        """(compute, host, disk) fractions for "weights", "cache" or "act"."""
        gpu, cpu = {"weights": self.percent[0:2], "cache": self.percent[2:4], "act": self.percent[4:6]}[what]
        return gpu / 100.0, cpu / 100.0, max(0.0, 100.0 - gpu - cpu) / 100.0

    def validate(self) -> "OffloadPolicy":
        for name, value in zip(("w_gpu", "w_cpu", "cache_gpu", "cache_cpu", "act_gpu", "act_cpu"), self.percent):
            if not 0 <= value <= 100:
                raise ConfigError(f"--percent {name}={value:g} is outside 0..100")
        for what, (a, b) in (("weights", self.percent[0:2]), ("cache", self.percent[2:4]),
                             ("activations", self.percent[4:6])):
            if a + b > 100:
                raise ConfigError(f"--percent for {what} sums to {a + b:g} > 100 (gpu + cpu; disk takes the rest)")
        if self.gpu_batch_size < 1 or self.num_gpu_batches < 1:
            raise ConfigError(f"--gpu-batch-size ({self.gpu_batch_size}) and --num-gpu-batches "
                              f"({self.num_gpu_batches}) must be >= 1")
        if self.prefill_batch_size is not None and self.prefill_batch_size < 1:
            raise ConfigError(f"--prefill-batch-size must be >= 1, got {self.prefill_batch_size}")
        if self.kv_dtype not in ("float16", "float32", "fp16", "fp32"):    # the others need torch: ask the registry
            try:                       # a plain storage format of flexgen_h2o.formats, by name or dtype name
                plain = not self.kv_format.quantized
            except ValueError as e:
                raise ConfigError(f"kv_dtype: {e}") from None
            if not plain:
                raise ConfigError(f"kv_dtype {self.kv_dtype!r} names a quantized format: give kv_bits instead")
        for flag, bits in (("--kv-bits", self.kv_bits), ("--weight-bits", self.weight_bits)):
            if bits is not None and bits not in (4, 8):
                raise ConfigError(f"{flag} must be 4 or 8, got {bits}")
        if self.group_size < 2 or self.group_size % 2:
            raise ConfigError(f"--group-size must be an even number >= 2, got {self.group_size}")
        return self

    def prefill_rows(self, batch: int, prompt_len: int, device_type: str = "cpu") -> int:
        """Sequences of one GPU batch that go through a layer together at prefill. The prompt's transients
        (MLP intermediates, attention chunks) grow with sequences x prompt length, while decode wants one large
        GPU batch; chunking the prefill decouples the two, so the batch is bounded by the KV, not the prompt."""
        tokens = PREFILL_TOKENS if device_type == "cpu" else PREFILL_TOKENS_GPU
        rows = self.prefill_batch_size or max(1, tokens // max(1, prompt_len))
        return max(1, min(batch, rows))

    def prefill_by_rows(self, device_type: str) -> bool:
        """Whether a prompt goes through every layer one prefill chunk at a time, instead of every chunk through
        one layer at a time. On a CPU with no disk-homed weight, staging a layer copies nothing (resident matrices
        are used where they lie), so the zig-zag's one weight pass per block saves nothing at prefill, while
        resting the whole GPU batch's prompt hidden state between layers costs batch x prompt x width in fp32
        (SmolLM2 at 54 x 2048: 243 MiB). Chunk by chunk, only one chunk's hidden state exists at a time."""
        return device_type == "cpu" and not self.weights_on_disk

    def kv_read_in_place(self, attention_device_type: str, rolling: bool, batch: int) -> bool:
        """Whether decode attention reads a GPU batch's fp16 cache where it lies instead of an upcast copy
        (ops.narrow_decode_attention): attention on a CPU, the batch's cache one part homed in RAM, no position
        rolling. A split cache's parts are joined into one copy; rolling re-rotates every key anyway; a disk-homed
        cache's copy is the read that the KV lane's worker thread overlaps with compute."""
        parts = split_by_fraction(batch, self.tier_fractions("cache"))
        narrow = self.kv_format.quantized or self.kv_format.itemsize < 4
        return (attention_device_type == "cpu" and narrow and not rolling and len(parts) == 1
                and parts[0][2] != "disk")

    @property
    def kv_format(self):
        """The KV cache's StorageFormat (flexgen_h2o.formats): group-wise int4/int8 with kv_bits, else kv_dtype."""
        from flexgen_h2o.formats import quant_format, storage_format   # torch-free config: imported when asked
        return quant_format(self.kv_bits, self.group_size) if self.kv_bits else storage_format(self.kv_dtype)

    @property
    def weight_format(self):
        """The weight matrices' StorageFormat: group-wise int4/int8 with weight_bits, else the store's fp16."""
        from flexgen_h2o.formats import WEIGHT_FORMAT, quant_format
        return quant_format(self.weight_bits, self.group_size) if self.weight_bits else WEIGHT_FORMAT

    def replace(self, **changes) -> "OffloadPolicy":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 32
    temperature: float = 0.0           # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                     # 0 = off
    seed: int = 0
    stop: tuple[str, ...] = ()         # stop strings, checked per sequence on the decoded text
    stop_at_eos: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def validate(self) -> "GenerationConfig":
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.temperature < 0 or self.top_k < 0:
            raise ConfigError("temperature and top_k must be >= 0")
        return self


@dataclass
class GenerationResult:
    token_ids: list[list[int]]                 # generated ids per prompt (after stop truncation)
    texts: list[str]                           # decoded generations ("" when no tokenizer)
    finish_reasons: list[str]                  # "eos", "stop", or "length"
    prompt_lens: list[int]                     # real prompt tokens per prompt
    metrics: dict = field(default_factory=dict)
