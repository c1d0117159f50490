"""Public entry points of the codec: `compress`, `decompress`, `sum_packed`, `check_wire`.

Each takes ``tuning=`` (a `Tuning`; default ``Tuning()``) for the kernels' launch settings, and
hands the work to `dispatch`, which picks the implementation.

Where a buffer meets a config (`decompress`, `sum_packed`) the chunks' headers (`layout`) must
say that config, or `WireFormatError` is raised: a buffer read under another config would decode
to wrong numbers. On the CPU every call checks. On a GPU reading the headers costs a host sync,
which would stall the collectives (they overlap codec kernels and transfers without one) and
cannot run while a CUDA graph is captured; there the first buffer of each (config, layout,
device) is checked and later ones are not: a config that differs between ranks or call sites
differs from the first call on. `check_wire` checks any buffer on demand.

A caller may tag the chunks it encodes (``tag=``, 16 bits in the header: `layout.length_tag`):
the collectives of `comm` tag them with the whole message's length, so that a peer that sent a
message of another length fails the same check. They check every chunk they receive on the
device instead (`compare_headers`, then ``check=False`` on the read): no host sync, on every
call and every device; a chunk whose header differs has its scales set to NaN (its values
decode and sum to NaN, never to plausible numbers) and is counted in the caller's mismatches,
which the caller reads at its next host sync (`raise_mismatches`, or one read for many callers:
`mismatch_flag` and `settle_flags`); on the CPU, where reading costs nothing, at once
(`read_at_once`), unless ``TACO_DEFER_HEADER_READS=1`` defers the CPU's reads too (the GPU's
path, run on the CPU: how its tests run it).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..errors import ConfigTypeError, EnvironmentSettingError, GroupOverflowError, NonFiniteError, WireFormatError
from . import dispatch
from .config import CodecConfig
from .layout import WireLayout, describe_header, signed_header, tag_difference
from .tuning import DEFAULT_TUNING, Tuning

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class Packed:
    """A compressed tensor: the wire ``buffer`` plus what is needed to decode it.

    ``buffer`` is one contiguous 1-D uint8 tensor laid out as `layout.WireLayout` describes;
    ``shape`` and ``dtype`` are those of the original tensor.
    """

    buffer: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    config: CodecConfig
    layout: WireLayout

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @property
    def device(self) -> torch.device:
        return self.buffer.device


def _check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"compress expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"compress supports {SUPPORTED_DTYPES}, got {x.dtype}; cast the tensor first")
    if x.is_meta:
        raise ValueError(f"compress got a meta tensor (shape {list(x.shape)}: no data to encode); materialise it "
                         "first, e.g. model.to_empty(device=...) and load its weights, or x = torch.empty_like(x, "
                         "device='cpu')")


def check_config(config: object, where: str) -> CodecConfig:
    """``config`` itself if it is a `CodecConfig` (a `TacoConfig` is one); a `ConfigTypeError` (a
    TypeError) naming the fix otherwise (a format name, a dict)."""
    if isinstance(config, CodecConfig):
        return config
    if isinstance(config, str):
        fix = f"TacoConfig(format={config!r})" if config in ("e4m3", "e5m2", "int8") else "TacoConfig(...)"
    elif isinstance(config, dict):
        fix = "TacoConfig(**config) (or TacoConfig.from_dict(config))"
    else:
        fix = "a TacoConfig"
    raise ConfigTypeError(f"{where}: config={config!r} is a {type(config).__name__}, not a TacoConfig; pass {fix}")


def _check_out(out: torch.Tensor, nbytes: int, device: torch.device, what: str) -> None:
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != nbytes or out.device != device:
        raise ValueError(
            f"out= for {what} must be a 1-D uint8 tensor of {nbytes} bytes on {device}, got {out.dtype} "
            f"{list(out.shape)} on {out.device}"
        )


def _raise_if_nonfinite(x: torch.Tensor, buffer: torch.Tensor, layout: WireLayout) -> None:
    """NonFiniteError if a group's scale is NaN: `GroupOverflowError` when every such group holds
    only finite values (the transform overflowed fp32), else the input holds NaN or Inf."""
    bad = ~torch.isfinite(layout.scales(buffer)).all(dim=1).reshape(-1)  # [groups], group order
    if not bool(bad.any()):
        return
    g = layout.group_size
    groups = torch.zeros(layout.padded_numel, dtype=x.dtype, device=x.device)
    groups[: layout.numel] = x.reshape(-1)
    groups = groups.view(-1, g)[bad]
    if bool(torch.isfinite(groups).all()):
        first = int(bad.nonzero()[0])
        raise GroupOverflowError(
            f"group {first} of the tensor to compress (values {first * g}..{first * g + g - 1}) is finite but "
            f"too large for the codec: max |x| = {float(groups[0].abs().max()):.3g}, and its transform sums "
            f"{g} values in fp32, which overflows past {FP32_MAX:.3g} (groups with max |x| below "
            f"{FP32_MAX / g:.3g} always fit). Scale the tensor down before compressing it, or choose "
            "TacoConfig.nonfinite='propagate' (such a group decodes to NaN)"
        )
    raise NonFiniteError(
        "the tensor to compress holds NaN or Inf (TacoConfig.nonfinite='raise'); find where the run "
        "diverges, or choose nonfinite='propagate' (decode to NaN) or 'zero'"
    )


_verified_on_device: set[tuple] = set()  # (header, layout, device) checked once on a GPU (module docstring)


def check_wire(buffer: torch.Tensor, layout: WireLayout, config: CodecConfig, tag: int = 0) -> None:
    """Raise `WireFormatError` unless every chunk header of ``buffer`` (one buffer of ``layout``,
    or a stack of them, ``[..., total_bytes]``) says ``config`` and the message tag ``tag``. Reads
    the headers: a host sync on a GPU."""
    if layout.group_size != config.group_size or layout.num_scales != config.num_scales:
        raise WireFormatError(
            f"{layout} does not belong to TacoConfig(group_size={config.group_size}, scales={config.scales!r}); "
            "build the layout with WireLayout.for_tensor(numel, config, chunks)"
        )
    if not layout.used_bytes:
        return
    expected = signed_header(config, tag)
    words = layout.headers(buffer)
    wrong = words != expected
    if bool(wrong.any()):
        where = wrong.nonzero()[0].tolist()
        word = int(words[tuple(where)])
        place = f"input {where[0]}, chunk {where[1]}" if len(where) == 2 else f"chunk {where[0]}"
        if (word ^ expected) & 0xFFFF == 0 and tag:  # the settings agree; the tag, or the sign seed, does not
            raise WireFormatError(
                f"{place} of the buffer belongs to {tag_difference(config)} (bytes 2-3 of its header "
                f"{(word >> 16) & 0xFFFF:#06x}, expected {(expected >> 16) & 0xFFFF:#06x}): {SIZES_DIFFER}"
            )
        raise WireFormatError(
            f"{place} of the buffer was written with {describe_header(word)}, but is read with "
            f"{describe_header(expected)}: decode and sum a buffer under the TacoConfig that encoded it "
            "(every rank of a collective must pass the same config)"
        )


SIZES_DIFFER = ("the ranks of a collective sent messages of different sizes (or settings); every rank must send "
                 "the same shape at each call (pad the batch to one length on every rank of the group)")
DEFER_ENV = "TACO_DEFER_HEADER_READS"
READ_AT_ONCE: tuple[str, ...] | None = None  # `read_at_once`'s answer, once read (tests may set it)


def read_at_once() -> tuple[str, ...]:
    """The device types whose received headers `compare_headers` reads at once, where a read costs
    no host sync: the CPU, unless ``TACO_DEFER_HEADER_READS=1`` defers its reads as a GPU's are
    (the same code on CPU tensors). Read from the environment at first use (a process's ranks
    are started before they set it), kept in `READ_AT_ONCE`."""
    global READ_AT_ONCE
    if READ_AT_ONCE is None:
        text = os.environ.get(DEFER_ENV, "").strip().lower()
        if text not in ("", "0", "1", "false", "true", "no", "yes", "off", "on"):
            raise EnvironmentSettingError(f"{DEFER_ENV}={text!r} is not a switch; set it to 1 (read the wire headers "
                                          "of CPU collectives at the next host sync, as on a GPU) or 0 / unset it")
        READ_AT_ONCE = () if text in ("1", "true", "yes", "on") else ("cpu",)
    return READ_AT_ONCE


class HeaderViews(NamedTuple):
    """What `compare_headers` reads and poisons in a received buffer (`header_views`: made once
    by the caller, reused from call to call)."""

    headers: torch.Tensor  # [..., chunks, 1] int32
    scales: torch.Tensor  # [..., chunks, num_scales * gpc] fp32
    shape: torch.Size  # the headers' shape: the key of their flags
    device: torch.device
    captured: bool  # made while a CUDA graph was captured: each replay compares again


def header_views(buffer: torch.Tensor, layout: WireLayout) -> HeaderViews:
    """The `HeaderViews` of ``buffer`` (one buffer of ``layout`` or a stack of them)."""
    headers, scales = layout.headers_and_scales(buffer)
    device = buffer.device
    return HeaderViews(headers, scales, headers.shape, device,
                       device.type == "cuda" and torch.cuda.is_current_stream_capturing())


class HeaderFlags:
    """The header comparisons of one caller (a site) since its last read, kept on their device
    (`compare_headers` writes them; `raise_mismatches`, `any_mismatch` and `mismatch_flag` read
    them): per header shape, a ring of `RING` bool rows. Each comparison is written straight into
    the next row (the comparison is the flag: no second operation to or it into one); a read that
    finds them all False starts the ring over, and a ring used up between reads has its rows
    or-ed into row 0 (two operations). A comparison captured in a CUDA graph, which each replay
    writes again, is or-ed into row 0 instead (such a ring is read at every read)."""

    RING = 64
    __slots__ = ("rings",)

    def __init__(self) -> None:
        self.rings: dict[torch.Size, _Ring] = {}

    def compare(self, views: HeaderViews, expected: torch.Tensor) -> torch.Tensor:
        """``views.headers != expected``, kept; returns the comparison."""
        ring = self.rings.get(views.shape)
        if ring is None:
            ring = self.rings[views.shape] = _Ring(views.shape, views.device, self.RING)
        if views.captured:
            differs = torch.ne(views.headers, expected)
            ring.rows[0].logical_or_(differs)
            ring.captured = True
            return differs
        used = ring.used
        if used == self.RING:
            torch.any(ring.stack, 0, out=ring.folded)
            ring.rows[0].copy_(ring.folded)
            used = 1
        ring.used = used + 1
        return torch.ne(views.headers, expected, out=ring.rows[used])

    def pending(self) -> list["_Ring"]:
        """The rings written since their last read (no host read: Python counters)."""
        return [ring for ring in self.rings.values() if ring.used > 1 or ring.captured]

    def __bool__(self) -> bool:
        return bool(self.rings)

    def clear(self) -> None:
        self.rings.clear()


class _Ring:
    __slots__ = ("stack", "rows", "folded", "used", "captured")

    def __init__(self, shape: torch.Size, device: torch.device, length: int) -> None:
        self.stack = torch.zeros((length, *shape), dtype=torch.bool, device=device)
        self.rows, self.folded, self.used = self.stack.unbind(0), torch.empty(shape, dtype=torch.bool, device=device), 1
        self.captured = False


def compare_headers(buffer: torch.Tensor, layout: WireLayout, config: CodecConfig, tag: int, flags: HeaderFlags,
                    views: HeaderViews | None = None) -> None:
    """Compare every chunk header of ``buffer`` (one buffer of ``layout`` or a stack of them) with
    ``config``'s and ``tag``'s on the buffer's device, without a host sync: the scales of a chunk
    that differs become NaN, so that its values decode and sum to NaN, and the comparison is
    kept in ``flags`` (the caller's) for `raise_mismatches` to read at the caller's next host
    sync. On a device of `READ_AT_ONCE` a mismatch raises `WireFormatError` here, naming the
    chunk and what it was written with. ``views``: the buffer's, cached by the caller."""
    if not layout.used_bytes:
        return
    if views is None:
        views = header_views(buffer, layout)
    expected = _header_tensor(config, tag)
    if views.device.type in (READ_AT_ONCE if READ_AT_ONCE is not None else read_at_once()):
        if bool(torch.ne(views.headers, expected).any()):
            check_wire(buffer, layout, config, tag)  # raises, naming the chunk and its settings
        return
    views.scales.masked_fill_(flags.compare(views, expected), _NAN)


_NAN = torch.tensor(float("nan"))  # 0-d CPU tensors as operands: a third of a Python scalar's host time


@functools.lru_cache(maxsize=4096)
def _header_tensor(config: CodecConfig, tag: int) -> torch.Tensor:
    return torch.tensor(signed_header(config, tag), dtype=torch.int32)


def raise_mismatches(flags: HeaderFlags, where: str) -> None:
    """Raise `WireFormatError` (naming ``where``) if a chunk compared by `compare_headers` into
    ``flags`` since the last raise differed, and start afresh. Reads the flags: a host sync on a
    GPU (flags that are all False stay, to be written into: no allocation from call to call)."""
    if any_mismatch([flags]):
        flags.clear()
        raise WireFormatError(
            f"{where}: a chunk received since the last check did not carry this rank's header (another TacoConfig, "
            f"or a message of another length or sign_seed; its values were read as NaN): {SIZES_DIFFER}"
        )


def any_mismatch(flag_sets: list[HeaderFlags]) -> bool:
    """Whether a chunk compared by `compare_headers` into any of ``flag_sets`` (each a caller's
    `HeaderFlags`) since their last read differed: one host read for all of them (none when
    nothing was compared since, nor while a CUDA graph is captured: False then). For callers
    holding many sites' flags (`raise_mismatches` each one only where this is True)."""
    rings = [ring for flags in flag_sets for ring in flags.pending()]
    if not rings or (rings[0].stack.is_cuda and torch.cuda.is_current_stream_capturing()):
        return False
    flag, marks = mismatch_flag(flag_sets, rings[0].stack.device)
    found = bool(flag)
    settle_flags(marks, found)
    return found


class FlagMarks(NamedTuple):
    """What `mismatch_flag` covered: each ring it read and how far it was written then."""

    rings: list
    used: list[int]


def mismatch_flag(flag_sets: list[HeaderFlags], device) -> tuple[torch.Tensor, FlagMarks]:
    """A 0-d float32 tensor on ``device``, 1.0 where a chunk compared into any of ``flag_sets``
    since their last read differed, else 0.0, without a host read: for a caller to fold into a
    collective or a host read it makes anyway; then `settle_flags` with what it read. Reads the
    rings written since their last read only (a few operations per device, whatever the number
    of sites)."""
    rings = [ring for flags in flag_sets for ring in flags.pending()]
    marks = FlagMarks(rings, [ring.used for ring in rings])
    flag = torch.zeros((), dtype=torch.float32, device=device)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for ring in rings:
        by_device.setdefault(ring.stack.device, []).append(ring.stack.view(-1))
    for stacks in by_device.values():
        found = (stacks[0] if len(stacks) == 1 else torch.cat(stacks)).any()
        flag = torch.maximum(flag, found.to(device=device, dtype=torch.float32))
    return flag, marks


def settle_flags(marks: FlagMarks, found: bool) -> None:
    """After a caller read `mismatch_flag`'s value (``found``: it was set, on this rank or, for a
    value reduced over ranks, on any): where none was found, the rings it covered are read and
    written over again, unless written since; where one was, the caller raises
    (`raise_mismatches` names the site)."""
    if found:
        return
    for ring, used in zip(marks.rings, marks.used):
        if ring.used == used:
            ring.used = 1


def _check_wire_where_cheap(buffer: torch.Tensor, layout: WireLayout, config: CodecConfig, tag: int = 0) -> None:
    """`check_wire` on every CPU buffer; elsewhere once per (config and tag, layout, device) in
    the process, and never while a CUDA graph is captured (module docstring)."""
    device = buffer.device
    if device.type == "cpu":
        check_wire(buffer, layout, config, tag)
        return
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    verified = _verified_on_device
    key = (signed_header(config, tag), layout, device)
    if key not in verified:
        check_wire(buffer, layout, config, tag)
        if len(verified) >= 4096:  # many sizes: start over rather than grow
            verified.clear()
        verified.add(key)


def compress(x: torch.Tensor, config: CodecConfig | None = None, *, chunks: int = 1,
             tuning: Tuning | None = None, out: torch.Tensor | None = None) -> Packed:
    """Encode ``x`` (fp32 / fp16 / bf16, any shape, any numel) into one wire buffer.

    ``chunks`` > 1 cuts the buffer into that many equal chunks of whole groups (the unit the
    two-shot all-reduce sends to each rank). ``out``: the buffer to write (1-D uint8 of the
    layout's ``total_bytes``, e.g. reused from call to call); a new one otherwise.
    """
    _check_input(x)
    config = _DEFAULT if config is None else check_config(config, "compress")
    layout = WireLayout.for_tensor(x.numel(), config, chunks)
    if out is None:
        out = torch.empty(layout.total_bytes, dtype=torch.uint8, device=x.device)
    else:
        _check_out(out, layout.total_bytes, x.device, "compress")
    encode_into(x if x.is_contiguous() else x.contiguous(), out, layout, config, tuning)
    return Packed(out, x.shape, x.dtype, config, layout)


def decompress(packed: Packed, out: torch.Tensor | None = None, *, tuning: Tuning | None = None) -> torch.Tensor:
    """Decode ``packed`` to a tensor of its original shape, dtype and device (or into ``out``)."""
    if not isinstance(packed, Packed):
        raise TypeError(f"decompress expects the Packed that compress returned, got {type(packed).__name__}")
    if packed.buffer.dim() != 1 or packed.buffer.numel() != packed.layout.total_bytes:
        raise ValueError(
            f"packed.buffer has {packed.buffer.numel()} bytes but its layout needs "
            f"{packed.layout.total_bytes}: the buffer does not belong to this layout"
        )
    if out is None:
        out = torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)
    elif out.numel() != packed.layout.numel or not out.is_contiguous() or out.device != packed.device:
        raise ValueError(f"out must be a contiguous tensor of {packed.layout.numel} elements on {packed.device}")
    decode_into(packed.buffer, packed.layout, packed.config, out, tuning)
    return out


def sum_packed(stacked: torch.Tensor, layout: WireLayout, config: CodecConfig, *,
               tuning: Tuning | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The reduce step of the two-shot all-reduce: dequantise, sum in fp32 and requantise.

    ``stacked`` is [P, layout.total_bytes] uint8 (P buffers of one layout, e.g. the chunk
    every peer sent to this rank); returns one buffer of that layout holding their sum, still
    in the transformed domain (no inverse transform is needed). ``out``: the buffer to write
    (1-D uint8 of ``layout.total_bytes``); a new one otherwise.
    """
    config = check_config(config, "sum_packed")
    if stacked.dim() != 2 or stacked.shape[1] != layout.total_bytes or stacked.dtype != torch.uint8:
        raise ValueError(
            f"sum_packed expects uint8 [P, {layout.total_bytes}], got {stacked.dtype} {list(stacked.shape)}"
        )
    if out is None:
        out = torch.empty(layout.total_bytes, dtype=torch.uint8, device=stacked.device)
    else:
        _check_out(out, layout.total_bytes, stacked.device, "sum_packed")
    sum_packed_into(stacked, layout, config, out, tuning)
    return out


# --- the same steps into buffers the caller owns, without the argument checks -----------------
# (`comm` computes the layouts and keeps the buffers; the wire headers are still checked)


def encode_into(x: torch.Tensor, out: torch.Tensor, layout: WireLayout, config: CodecConfig,
                tuning: Tuning | None = None, tag: int = 0, headers: torch.Tensor | None = None) -> None:
    """`compress` of the contiguous ``x`` (``layout.numel`` values) into ``out`` (the layout's
    uint8 buffer), its headers carrying the message tag ``tag`` (``headers``: the caller's
    cached `WireLayout.headers` view of ``out``, which saves making it)."""
    if layout.numel:
        dispatch.compress_into(x if x.dim() == 1 else x.view(-1), out, layout, config, tuning or DEFAULT_TUNING)
        if tag:
            (layout.headers(out) if headers is None else headers).fill_(signed_header(config, tag))
        if config.nonfinite == "raise":
            _raise_if_nonfinite(x, out, layout)


def encode_rows_into(rows: torch.Tensor, out: torch.Tensor, layout: WireLayout, config: CodecConfig,
                     tuning: Tuning | None = None, tag: int = 0, stage: torch.Tensor | None = None) -> WireLayout:
    """Every row of ``rows`` [R, layout.numel] encoded under ``layout`` into ``out`` (R buffers of
    ``layout.total_bytes``, row order), in one codec call: bit for bit the R calls of
    `encode_into`, since the codec works group by group and a chunk is whole groups (each row is
    first padded with zeros to whole chunks, in ``stage`` [R, layout.padded_numel] of the rows'
    dtype where the rows need it). Returns the layout of ``out`` as one buffer: the rows' padded
    values in ``R * layout.chunks`` chunks of ``layout``'s groups per chunk."""
    count, width = rows.shape[0], layout.padded_numel
    if width != layout.numel or not rows.is_contiguous():
        if stage is None:
            stage = rows.new_empty((count, width))
        stage[:, layout.numel:].zero_()
        stage[:, : layout.numel].copy_(rows.reshape(count, -1))
        rows = stage
    whole = WireLayout.for_tensor(count * width, config, count * layout.chunks)
    tuning = tuning or DEFAULT_TUNING  # the encoder one row alone would get (chosen by its group count)
    encode_into(rows.reshape(-1), out, whole, config, tuning.replace(split_max_groups=count * tuning.split_max_groups), tag)
    return whole


def decode_into(buffer: torch.Tensor, layout: WireLayout, config: CodecConfig, out: torch.Tensor,
                tuning: Tuning | None = None, tag: int = 0, check: bool = True) -> None:
    """`decompress` of ``buffer`` (one buffer of ``layout``, tagged ``tag``) into the contiguous
    ``out``. ``check=False``: the caller compared the headers (`compare_headers`), or wrote them."""
    if layout.numel:
        if check:
            _check_wire_where_cheap(buffer, layout, config, tag)
        dispatch.decompress_into(buffer, layout, config, out if out.dim() == 1 else out.view(-1),
                                 tuning or DEFAULT_TUNING)


def sum_packed_into(stacked: torch.Tensor, layout: WireLayout, config: CodecConfig, out: torch.Tensor,
                    tuning: Tuning | None = None, tag: int = 0, check: bool = True) -> None:
    """`sum_packed` of ``stacked`` [P, layout.total_bytes] (tagged ``tag``) into ``out`` (the
    layout's uint8 buffer, tagged alike; ``check``: as in `decode_into`)."""
    if layout.numel:
        if check:
            _check_wire_where_cheap(stacked, layout, config, tag)
        dispatch.sum_into(stacked, layout, config, out, tuning or DEFAULT_TUNING)
        if tag:
            layout.headers(out).fill_(signed_header(config, tag))


_DEFAULT = CodecConfig()
