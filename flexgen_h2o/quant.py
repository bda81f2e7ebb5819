"""Group-wise asymmetric min-max quantization, FlexGen's compression: the stored form of 4-bit and 8-bit formats.

Values are cut into groups of `group_size` consecutive elements along one dimension; each group keeps its minimum
and its step, (max - min) / (2^bits - 1), both in fp16, and every value becomes round((x - min) / step), an
integer in [0, 2^bits - 1]. 4-bit values are packed two to a byte (the even element in the low nibble). Reading
back gives min + q * step: within half a step of x (plus the fp16 rounding of min and step), and exactly x where x
already lies on its group's grid. A dimension that `group_size` does not divide gets a last, padded group; the
padding repeats the dimension's last value, so it never widens that group's range.

Bytes per group of g values: g * bits / 8 of data + 4 (fp16 min and step). For a 64-wide head at 4 bits that is
36 bytes against fp16's 128 (0.28x); at 8 bits 68 (0.53x).

The row form (pack_rows) keeps a whole last-dimension row in one byte row, so a KV slot or a weight row is one
uint8 row that slicing, gathers, memmaps and copies move like any other tensor's rows:

    [ packed values: n_groups * group_size * bits / 8 | fp16 minimum x n_groups | fp16 step x n_groups ]

The compiled kernels (kernels/csrc/quant_linear.cpp, decode_attention.cpp) read this layout in place.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

PARAM_DTYPE = torch.float16          # the per-group minimum and step, as FlexGen keeps them


@dataclass(frozen=True)
class Quantized:
    """A tensor in its quantized stored form."""
    data: Tensor                     # uint8 (..., n_groups * group_size * bits / 8), the grouped dimension last
    minimum: Tensor                  # PARAM_DTYPE (..., n_groups)
    step: Tensor                     # PARAM_DTYPE (..., n_groups)
    shape: tuple[int, ...]           # the original shape
    dim: int                         # the grouped dimension, non-negative

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.minimum, self.step))


@dataclass(frozen=True)
class GroupQuant:
    """A quantized storage format: `bits` 4 or 8, groups of `group_size` along dimension `dim` of what it packs."""
    bits: int = 4
    group_size: int = 64
    dim: int = -1

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.group_size < 2 or self.group_size % 2:
            raise ValueError(f"group_size must be an even number >= 2 (4-bit values pack in pairs), "
                             f"got {self.group_size}")

    @property
    def name(self) -> str:
        return f"int{self.bits}-g{self.group_size}"

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    def nbytes(self, numel: int, dim_size: int | None = None) -> int:
        """Stored bytes of `numel` values whose grouped dimension is `dim_size` long (default: all of them in one
        row): the packed data plus an fp16 minimum and step per group."""
        dim_size = numel if dim_size is None else dim_size
        rows = numel // dim_size if dim_size else 0
        groups = math.ceil(dim_size / self.group_size)
        return rows * groups * (self.group_size * self.bits // 8 + 2 * PARAM_DTYPE.itemsize)

    def groups(self, n: int) -> int:
        return math.ceil(n / self.group_size)

    def row_bytes(self, n: int) -> int:
        """Bytes of one row of n values in the row form."""
        return self.nbytes(n, n)

    def pack_rows(self, x: Tensor) -> Tensor:
        """x (..., n) as uint8 rows (..., row_bytes(n)), grouped along the last dimension (the row form)."""
        stored = GroupQuant(self.bits, self.group_size, -1).pack(x)
        params = torch.cat([stored.minimum, stored.step], dim=-1).view(torch.uint8)
        return torch.cat([stored.data, params], dim=-1)

    def unpack_rows(self, rows: Tensor, n: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """uint8 rows (..., row_bytes(n)) back as (..., n) values in `dtype`."""
        groups = self.groups(n)
        width = groups * self.group_size * self.bits // 8
        # a copy of its own: an odd data width would leave the fp16 parameters at an odd byte offset
        params = rows[..., width:].clone(memory_format=torch.contiguous_format).view(PARAM_DTYPE)
        stored = Quantized(rows[..., :width], params[..., :groups], params[..., groups:],
                           (*rows.shape[:-1], n), rows.dim() - 1)
        return self.unpack(stored, dtype)

    def pack(self, x: Tensor) -> Quantized:
        """x (any float dtype) in its stored form; computed in fp32."""
        dim = self.dim % x.dim()
        rows = x.float().movedim(dim, -1)
        n, g = rows.shape[-1], self.group_size
        pad = -n % g
        if pad:
            rows = torch.cat([rows, rows[..., -1:].expand(*rows.shape[:-1], pad)], dim=-1)
        groups = rows.reshape(*rows.shape[:-1], -1, g)
        low, high = groups.amin(-1), groups.amax(-1)
        minimum = low.to(PARAM_DTYPE)
        step = ((high - low) / self.levels).to(PARAM_DTYPE)
        # the stored (fp16) minimum and step are what unpack uses: quantize against them, not the fp32 ones
        step32 = step.float()
        step32 = torch.where(step32 > 0, step32, torch.ones_like(step32))            # a constant group: q = 0
        q = ((groups - minimum.float()[..., None]) / step32[..., None]).round_().clamp_(0, self.levels)
        q = q.to(torch.uint8).reshape(*rows.shape[:-1], -1)
        if self.bits == 4:
            q = q[..., 0::2] | (q[..., 1::2] << 4)
        return Quantized(q.contiguous(), minimum, step, tuple(x.shape), dim)

    def unpack(self, stored: Quantized, dtype: torch.dtype = torch.float32) -> Tensor:
        """The values back, in `dtype`, in the original shape."""
        q = stored.data
        if self.bits == 4:
            q = torch.stack([q & 0xF, q >> 4], dim=-1).reshape(*q.shape[:-1], -1)
        groups = q.reshape(*q.shape[:-1], -1, self.group_size).float()
        values = groups * stored.step.float()[..., None] + stored.minimum.float()[..., None]
        n = stored.shape[stored.dim]
        rows = values.reshape(*values.shape[:-2], -1)[..., :n]
        return rows.movedim(-1, stored.dim).to(dtype).contiguous()


@dataclass(frozen=True)
class PackedMatrix:
    """A weight matrix (n, k) staged in its packed row form: what ops.linear and the compiled quant_linear take in
    place of an fp16 matrix."""
    rows: Tensor                     # uint8 (n, row_bytes(k))
    n_in: int                        # k
    quant: GroupQuant

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows.shape[0], self.n_in

    @property
    def device(self) -> torch.device:
        return self.rows.device

    def values(self, dtype: torch.dtype, start: int = 0, stop: int | None = None) -> Tensor:
        """Rows [start, stop) dequantized, (stop - start, k) in `dtype`."""
        return self.quant.unpack_rows(self.rows[start:stop], self.n_in, dtype)
