"""The wire format: where every byte of a compressed tensor lives.

A compressed tensor is one contiguous 1-D ``torch.uint8`` buffer, so that one send moves it.
It is cut into ``chunks`` equal chunks (the two-shot all-reduce sends chunk r to rank r); a
plain `compress` uses one chunk. Each chunk holds ``gpc`` whole groups of G values, and is a
valid one-chunk buffer by itself (`WireLayout.chunk_layout`)::

    chunk c (chunk_bytes = gpc*G + 4*num_scales*gpc + 4 bytes rounded up to 16, c = 0..chunks-1)
    +-------------------------------+--------------------+--------------------+--------+---------+
    | payload: gpc*G bytes,         | scale[0]:          | scale[1]:          | header | padding |
    | fp8/int8; group j at bytes    | gpc x fp32, s/a    | gpc x fp32, a      | 4 bytes| 0-12    |
    | [j*G, (j+1)*G)                | ("single") or s    | (only "dual")      |        | zeros   |
    +-------------------------------+--------------------+--------------------+--------+---------+

The input is flattened and padded with zeros to ``chunks*gpc*G`` values; group g
(g = c*gpc + j) holds input values [g*G, (g+1)*G). Padded groups stay whole on the wire so
that the tail decodes exactly like any other group.

Inside a group the G payload bytes are the Hadamard coefficients in Sylvester order
(coefficient k of ``H_G @ (signs * x)`` at byte k); without the Hadamard step
(``hadamard=False``) they are the input values in order.

The header says how the chunk was encoded, so that a buffer decoded or summed under another
`TacoConfig` is an error (`WireFormatError`) instead of numbers (`header_word`): byte 0 is
0xA0 + the wire version (1); byte 1 holds log2(G) - 5 (bits 0-2), the format (bits 3-4: e4m3 0,
e5m2 1, int8 2), dual scales (bit 5), the Hadamard step (bit 6) and random signs (bit 7); bytes
2-3 a 16-bit hash of ``sign_seed`` (0 without random signs) XOR a 16-bit message tag (0 unless the
caller gives one: the collectives of `comm` tag every chunk with the length of the whole message,
`length_tag`, so that ranks whose messages differ in length fail the header check instead of
decoding each other's bytes as numbers). Bytes 2-3 alone cannot tell a seed from a length: a
chunk that differs only there belongs to a message of another length, or (with random signs) to
another ``sign_seed`` (`tag_difference`). Settings that do not change how bytes are read
(``adaptive_scale``, ``nonfinite``, ``backend``, the size settings) are not in it.

Each chunk ends with up to 12 zero bytes of padding to a multiple of 16 bytes, so that every
chunk, payload and scale section starts 16-byte aligned (the kernels then move 16 bytes per
memory access) and scales can be viewed as fp32. Encoders write the header and the padding:
equal data gives equal bytes.

Bytes per element: 1 + 4*num_scales/G (1.03125 for "single" at G=128, 1.0625 for "dual"), plus
the 4-byte header and the padding, at most 16 bytes per chunk.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass

import torch

from .config import CodecConfig

PAYLOAD_DTYPES = {
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
FORMAT_CODES = {"e4m3": 0, "e5m2": 1, "int8": 2}  # the kernels' FMT argument and the header's
HEADER_BYTES = 4
WIRE_VERSION = 1
HEADER_MAGIC = 0xA0  # high nibble of byte 0: a chunk of zeros or of another layout has no header


def length_tag(numel: int) -> int:
    """A 16-bit tag of a message length (every bit of ``numel`` counts: 4000 and 4000 + 65536
    differ)."""
    return (numel ^ (numel >> 16) ^ (numel >> 32) ^ (numel >> 48)) & 0xFFFF


@functools.lru_cache(maxsize=4096)
def header_word(config: CodecConfig, tag: int = 0) -> int:
    """The 4 header bytes of every chunk encoded under ``config`` with the message tag ``tag``
    (16 bits), as a little-endian uint32."""
    flags = (
        (config.group_size.bit_length() - 6)  # log2(G) - 5: G = 32..512
        | FORMAT_CODES[config.format] << 3
        | (config.scales == "dual") << 5
        | config.hadamard << 6
        | config.random_signs << 7
    )
    seed = zlib.crc32(config.sign_seed.to_bytes(8, "little")) & 0xFFFF if config.random_signs else 0
    return (HEADER_MAGIC | WIRE_VERSION) | flags << 8 | (seed ^ (tag & 0xFFFF)) << 16


def signed_header(config: CodecConfig, tag: int = 0) -> int:
    """`header_word` as a signed int32: the kernels' HEADER and the values of `WireLayout.headers`."""
    word = header_word(config, tag)
    return word - (1 << 32) if word >= 1 << 31 else word


def tag_difference(config: CodecConfig) -> str:
    """What a chunk belongs to whose header differs from ``config``'s only in bytes 2-3 (the seed
    hash XOR the message tag): with random signs, the two cannot be told apart."""
    if config.random_signs:
        return "a message of another length or another sign_seed"
    return "a message of another length"


def describe_header(word: int) -> str:
    """What a header word says, in `TacoConfig` terms (for error messages)."""
    word &= 0xFFFFFFFF
    if word & 0xF0 != HEADER_MAGIC:
        return f"no header (bytes {word.to_bytes(4, 'little').hex(' ')})"
    flags, formats = (word >> 8) & 0xFF, {v: k for k, v in FORMAT_CODES.items()}
    seed = f", sign seed hash {word >> 16:#06x}" if flags >> 7 else ""
    return (f"group_size={32 << (flags & 7)}, format={formats.get((flags >> 3) & 3, '?')!r}, "
            f"scales={'dual' if flags >> 5 & 1 else 'single'!r}, hadamard={bool(flags >> 6 & 1)}, "
            f"random_signs={bool(flags >> 7)}{seed} (wire version {word & 0x0F})")


@dataclass(frozen=True)
class WireLayout:
    """Sizes and offsets of one compressed tensor; see the module docstring."""

    numel: int
    group_size: int
    num_scales: int
    chunks: int = 1

    @classmethod
    def for_tensor(cls, numel: int, config: CodecConfig, chunks: int = 1) -> "WireLayout":
        """The layout of ``numel`` values under ``config`` in ``chunks`` chunks (one shared
        instance per distinct layout, so that its sizes are computed once)."""
        if chunks < 1:
            raise ValueError(f"chunks={chunks} must be >= 1")
        return _layout(numel, config.group_size, config.num_scales, chunks)

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
    def data_bytes(self) -> int:
        """Bytes of one chunk that carry the payload and the scales; the header follows them."""
        return self.payload_bytes_per_chunk + 4 * self.num_scales * self.groups_per_chunk

    @functools.cached_property
    def used_bytes(self) -> int:
        """Bytes of one chunk before its padding: payload, scales and header (none for no groups:
        an empty tensor is an empty buffer)."""
        return self.data_bytes + HEADER_BYTES if self.groups_per_chunk else 0

    @functools.cached_property
    def tail_bytes(self) -> int:
        """The header and the padding of one chunk (4, 8, 12 or 16 bytes): what follows the scales."""
        return self.chunk_bytes - self.data_bytes

    @functools.cached_property
    def chunk_bytes(self) -> int:
        return -(-self.used_bytes // 16) * 16

    @functools.cached_property
    def total_bytes(self) -> int:
        return self.chunks * self.chunk_bytes

    def chunk_layout(self) -> "WireLayout":
        """Layout of one chunk seen as a tensor of its own (gpc groups, one chunk)."""
        return _layout(self.payload_bytes_per_chunk, self.group_size, self.num_scales, 1)

    def headers(self, buffer: torch.Tensor) -> torch.Tensor:
        """View of the chunks' headers as ``[..., chunks]`` int32 (`header_word` values, signed);
        ``buffer`` is one buffer of this layout or a stack of them (``[..., total_bytes]``)."""
        rows = buffer.view(*buffer.shape[:-1], self.chunks, self.chunk_bytes)
        return rows[..., self.data_bytes : self.used_bytes].view(torch.int32).squeeze(-1)

    def headers_and_scales(self, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of every chunk's header, ``[..., chunks, 1]`` int32, and of its scales, ``[...,
        chunks, num_scales * gpc]`` fp32 (``buffer``: one buffer of this layout or a stack of
        them): a chunk's header next to the values it describes."""
        rows = buffer.view(*buffer.shape[:-1], self.chunks, self.chunk_bytes)
        scales = rows[..., self.payload_bytes_per_chunk : self.data_bytes].view(torch.float32)
        return rows[..., self.data_bytes : self.used_bytes].view(torch.int32), scales

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


@functools.lru_cache(maxsize=4096)
def _layout(numel: int, group_size: int, num_scales: int, chunks: int) -> WireLayout:
    return WireLayout(numel, group_size, num_scales, chunks)
