"""Storage formats: how a tensor is held at rest on a tier (weights in the store, KV in a cache, bytes a link
carries), apart from the dtype it is computed in.

One small type knows its bytes and how to pack a compute tensor into its stored form and back. The weight store,
the KV cache, the planner and the tiers ask it instead of writing `numel * 2`, and `stage` is the one copy path
by which KV windows, weights and hidden states reach the compute device (a quantized format dequantizes there).
There are two plain formats, fp16 (the default for weights and KV) and fp32 (bit-faithful KV for tests), and the
group-wise quantized ones of FlexGen's compression (QuantFormat: int4 and int8, flexgen_h2o.quant). A quantized
format stores each last-dimension row of n values as one uint8 row of `row_width(n)` bytes (quant.py's row form),
so a KV slot or a weight row is still one row of one tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from flexgen_h2o.quant import GroupQuant


@dataclass(frozen=True)
class StorageFormat:
    name: str                     # what the CLI, the plan and the report print: "fp16", "fp32"
    dtype: torch.dtype            # element type of the stored tensor

    @property
    def bits(self) -> int:
        return self.dtype.itemsize * 8

    @property
    def itemsize(self) -> int:
        """Bytes per stored element (a plain format: its dtype's)."""
        return self.dtype.itemsize

    quantized = False

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype({torch.float16: "<f2", torch.float32: "<f4", torch.uint8: "u1"}[self.dtype])

    def row_width(self, n: int) -> int:
        """Stored elements of one row of n values."""
        return n

    def nbytes(self, numel: int, row: int | None = None) -> int:
        """Bytes `numel` values take in this format, held as rows of `row` values (default: one row): what a tier
        holds and a link carries."""
        return int(numel) * self.itemsize

    def pack(self, x: Tensor) -> Tensor:
        """A compute tensor (..., n) in its stored form (..., row_width(n)) (a cast for the plain formats)."""
        return x.to(self.dtype)

    def unpack(self, stored: Tensor, n: int, dtype: torch.dtype) -> Tensor:
        """The stored rows back as (..., n) values in a compute dtype."""
        return stored.to(dtype)

    def stage(self, stored: Tensor, device: torch.device, dtype: torch.dtype, into: Tensor | None = None,
              non_blocking: bool = False, n: int | None = None) -> Tensor:
        """The stored form on `device` in `dtype`, written into `into` (a reused buffer of the values' shape, on
        `device` in `dtype`) or into a fresh tensor; never the stored tensor itself. n: values per row (a
        quantized format's rows do not say; `into` does)."""
        if into is not None:
            return into.copy_(stored, non_blocking=non_blocking)
        return stored.to(device=device, dtype=dtype, copy=True, non_blocking=non_blocking)


@dataclass(frozen=True)
class QuantFormat(StorageFormat):
    """FlexGen's group-wise min-max compression: `bits` 4 or 8, groups of `group_size` along each row (a KV slot's
    head_dim values; a weight's input dimension). A row shorter than the group is one group of its own length."""
    bits_per_value: int = 4
    group_size: int = 64
    quantized = True

    @property
    def bits(self) -> int:
        return self.bits_per_value

    def quant_for(self, n: int) -> GroupQuant:
        """The grouping of a row of n values."""
        return GroupQuant(self.bits_per_value, min(self.group_size, n + n % 2))

    def row_width(self, n: int) -> int:
        return self.quant_for(n).row_bytes(n)

    def nbytes(self, numel: int, row: int | None = None) -> int:
        row = int(numel) if row is None else row
        return int(numel) // row * self.row_width(row) if row else 0

    def pack(self, x: Tensor) -> Tensor:
        return self.quant_for(x.shape[-1]).pack_rows(x)

    def unpack(self, stored: Tensor, n: int, dtype: torch.dtype) -> Tensor:
        return self.quant_for(n).unpack_rows(stored, n, dtype)

    def stage(self, stored: Tensor, device: torch.device, dtype: torch.dtype, into: Tensor | None = None,
              non_blocking: bool = False, n: int | None = None) -> Tensor:
        """The compressed bytes cross to `device` and are dequantized there."""
        n = into.shape[-1] if into is not None else n
        if n is None:
            raise ValueError("a quantized format's rows do not say how many values they hold: pass n or into")
        values = self.unpack(stored.to(device, non_blocking=non_blocking), n, dtype)
        return values if into is None else into.copy_(values)


def quant_format(bits: int, group_size: int = 64) -> QuantFormat:
    """int4 or int8 groups of `group_size`; ValueError names what is wrong."""
    GroupQuant(bits, group_size)                      # checks bits and group_size
    return QuantFormat(f"int{bits}-g{group_size}", torch.uint8, bits, group_size)


FP16 = StorageFormat("fp16", torch.float16)
FP32 = StorageFormat("fp32", torch.float32)
FORMATS: dict[str, StorageFormat] = {f.name: f for f in (FP16, FP32)}
WEIGHT_FORMAT = FP16              # the converted store's format: weights are converted once, to fp16
# OffloadPolicy.kv_dtype's spellings (torch dtype names), kept for the API's users
_BY_DTYPE_NAME = {"float16": FP16, "float32": FP32}


def format_of(dtype: torch.dtype) -> StorageFormat:
    """The plain format that stores `dtype` (a model's own, bf16 say, in transformers' cache)."""
    return next((f for f in FORMATS.values() if f.dtype == dtype), None) or StorageFormat(str(dtype)[6:], dtype)


def storage_format(name: str) -> StorageFormat:
    """A format by its name ("fp16", "int4-g64") or its torch dtype's name ("float16")."""
    found = FORMATS.get(name) or _BY_DTYPE_NAME.get(name)
    if found is None and name.startswith("int") and "-g" in name:
        bits, group = name[3:].split("-g", 1)
        if bits.isdigit() and group.isdigit():
            found = quant_format(int(bits), int(group))
    if found is None:
        raise ValueError(f"unknown storage format {name!r}; choose one of {', '.join(FORMATS)}, int4-g64 or "
                         f"int8-g64")
    return found
