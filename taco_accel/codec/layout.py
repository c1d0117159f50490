"""The wire format: where every byte of a compressed tensor lives.

A compressed tensor is one contiguous 1-D ``torch.uint8`` buffer, so that one send moves it.
It is cut into ``chunks`` equal chunks (the two-shot all-reduce sends chunk r to rank r); a
plain `compress` uses one chunk. Each chunk holds ``gpc`` whole groups of G values::

    chunk c (chunk_bytes = gpc*G + 4*num_scales*gpc bytes rounded up to 16, c = 0..chunks-1)
    +--------------------------------------+-----------------------+-----------------------+
    | payload: gpc*G bytes, fp8/int8       | scale[0]: gpc x fp32  | scale[1]: gpc x fp32  |
    | group j at bytes [j*G, (j+1)*G)      | s/a ("single") or s   | a (only "dual")       |
    +--------------------------------------+-----------------------+-----------------------+

The input is flattened and padded with zeros to ``chunks*gpc*G`` values; group g
(g = c*gpc + j) holds input values [g*G, (g+1)*G). Padded groups stay whole on the wire so
that the tail decodes exactly like any other group.

Inside a group the G payload bytes are the Hadamard coefficients in Sylvester order
(coefficient k of ``H_G @ (signs * x)`` at byte k); without the Hadamard step
(``hadamard=False``) they are the input values in order. Each chunk is padded with up to 12
unused bytes to a multiple of 16 bytes, so that every chunk, payload and scale section starts
16-byte aligned (the kernels then move 16 bytes per memory access) and scales can be viewed
as fp32.

Bytes per element: 1 + 4*num_scales/G (1.03125 for "single" at G=128, 1.0625 for "dual").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .config import TacoConfig

PAYLOAD_DTYPES = {
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
FORMAT_CODES = {"e4m3": 0, "e5m2": 1, "int8": 2}  # the kernels' FMT argument


@dataclass(frozen=True)
class WireLayout:
    """Sizes and offsets of one compressed tensor; see the module docstring."""

    numel: int
    group_size: int
    num_scales: int
    chunks: int = 1

    @classmethod
    def for_tensor(cls, numel: int, config: TacoConfig, chunks: int = 1) -> "WireLayout":
        if chunks < 1:
            raise ValueError(f"chunks={chunks} must be >= 1")
        return cls(numel, config.group_size, config.num_scales, chunks)

    @functools.cached_property
    def groups_per_chunk(self) -> int:
        groups = -(-self.numel // self.group_size)
        return -(-groups // self.chunks)

    @functools.cached_property
    def num_groups(self) -> int:
        return self.groups_per_chunk * self.chunks

    @functools.cached_property
    def padded_numel(self) -> int:
        return self.num_groups * self.group_size

    @functools.cached_property
    def payload_bytes_per_chunk(self) -> int:
        return self.groups_per_chunk * self.group_size

    @functools.cached_property
    def used_bytes(self) -> int:
        """Bytes of one chunk that carry data (payload and scales)."""
        return self.payload_bytes_per_chunk + 4 * self.num_scales * self.groups_per_chunk

    @functools.cached_property
    def chunk_bytes(self) -> int:
        return -(-self.used_bytes // 16) * 16

    @functools.cached_property
    def total_bytes(self) -> int:
        return self.chunks * self.chunk_bytes

    def chunk_layout(self) -> "WireLayout":
        """Layout of one chunk seen as a tensor of its own (gpc groups, one chunk)."""
        return WireLayout(self.payload_bytes_per_chunk, self.group_size, self.num_scales, 1)

    def padding(self, buffer: torch.Tensor) -> torch.Tensor:
        """View of the padding bytes, ``[chunks, chunk_bytes - used_bytes]`` (may be empty).

        Encoders write zeros there, so that equal data gives equal bytes.
        """
        return buffer.view(self.chunks, self.chunk_bytes)[:, self.used_bytes :]

    def payload(self, buffer: torch.Tensor, fmt: str) -> torch.Tensor:
        """View of the payload as ``[chunks, gpc*G]`` in the payload dtype."""
        rows = buffer.view(self.chunks, self.chunk_bytes)
        return rows[:, : self.payload_bytes_per_chunk].view(PAYLOAD_DTYPES[fmt])

    def scales(self, buffer: torch.Tensor) -> torch.Tensor:
        """View of the scales as ``[chunks, num_scales, gpc]`` fp32."""
        rows = buffer.view(self.chunks, self.chunk_bytes)
        start = self.payload_bytes_per_chunk
        raw = rows[:, start : start + 4 * self.num_scales * self.groups_per_chunk].view(torch.float32)
        return raw.view(self.chunks, self.num_scales, self.groups_per_chunk)
