"""The settings of TACO: `CodecConfig` (how the codec encodes) and `TacoConfig` (that plus the
collective policy: an opt-in size floor, the piece size), each validated once. Which sites of a
model compress at all (off / on / auto) is `taco_accel.Compression`'s business, a layer above.

The codec (`codec.api`, the kernels, the wire header) reads only `CodecConfig`'s fields. The
policy fields of `TacoConfig` (``threshold_bytes``, ``piece_bytes``) are read where a collective
is started: `comm` takes the codec settings, the plain-or-compressed decision and the piece size
as separate, explicit values (``config.codec``, ``compress=``, ``piece_bytes``), and layer 3's
sites take the decision (the floor, then the auto mode's timing where asked) before they call it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

Format = Literal["e4m3", "e5m2", "int8"]
ScaleLayout = Literal["single", "dual"]
NonFinitePolicy = Literal["propagate", "raise", "zero"]
Backend = Literal["auto", "triton", "torch"]

FORMATS = ("e4m3", "e5m2", "int8")
SCALE_LAYOUTS = ("single", "dual")
NONFINITE_POLICIES = ("propagate", "raise", "zero")
BACKENDS = ("auto", "triton", "torch")
GROUP_SIZES = (32, 64, 128, 256, 512)
PIECE_BYTES = 32 * 2**20  # default piece size of the compressed collectives (see `comm.pieces`)

# Largest finite magnitude of each payload format (E5M2 has its own bound: the original
# implementation clamps it to 448 too, which wastes two binades).
QMAX = {"e4m3": 448.0, "e5m2": 57344.0, "int8": 127.0}


def _choice(cls: str, name: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{cls}.{name}={value!r} is not supported; use one of {allowed}")


@dataclass(frozen=True)
class CodecConfig:
    """How the TACO codec encodes a tensor (no collective policy: see `TacoConfig`).

    Args:
        group_size: values per quantisation group G (a power of two, 32..512). Pick one that
            divides the hidden size so that groups never straddle rows. Default 128.
        format: payload format: ``"e4m3"`` (default, finest near zero), ``"e5m2"`` (wider
            range) or ``"int8"`` (symmetric per-group INT8 on the same path).
        hadamard: apply the per-group Walsh-Hadamard transform (the paper's step 2).
            ``False`` exists for ablations.
        random_signs: multiply each group by a fixed random +-1 vector before the Hadamard
            transform (as QuaRot and TransformerEngine do). The vector is derived from
            ``sign_seed`` so that every rank uses the same one.
        adaptive_scale: the paper's step 1 (``a = FP8_MAX / rms``). It cancels against the
            absmax scale except through its clamps; only meaningful with ``scales="dual"``.
        scales: wire layout of the per-group scales. ``"dual"`` is the paper's: two fp32 per
            group (s and a), 1.0625 bytes per element at G=128. ``"single"`` sends the one
            effective scale s/a, 1.03125 bytes per element, with the same decoded values up to
            fp32 rounding (see ``python -m taco_accel.bench.fidelity``).
        nonfinite: what to do with NaN / Inf inputs. ``"propagate"`` (default): the group
            decodes to NaN, so a diverging run stays visible. ``"raise"``: raise
            `NonFiniteError` (costs one device sync per call). ``"zero"``: replace the
            non-finite values by 0, as the original TACO silently does. A group of finite
            values too large for the transform's fp32 sums (max |x| past about 3.4e38 / G)
            decodes to NaN under every policy; ``"raise"`` raises `GroupOverflowError` for it.
            Finite values never decode to inf (fp16 output saturates at 65504).
        backend: ``"auto"`` uses the fused Triton kernels on CUDA tensors and the PyTorch
            reference elsewhere; ``"triton"`` or ``"torch"`` force one.
        sign_seed: seed of the random sign vector.
    """

    group_size: int = 128
    format: Format = "e4m3"
    hadamard: bool = True
    random_signs: bool = False
    adaptive_scale: bool = True
    scales: ScaleLayout = "single"
    nonfinite: NonFinitePolicy = "propagate"
    backend: Backend = "auto"
    sign_seed: int = 0x7AC0

    def __post_init__(self) -> None:
        cls = type(self).__name__
        if (
            isinstance(self.group_size, bool)
            or not isinstance(self.group_size, int)
            or self.group_size not in GROUP_SIZES
        ):
            raise ValueError(
                f"{cls}.group_size={self.group_size!r} is not supported; use a power of "
                f"two in {GROUP_SIZES}"
            )
        _choice(cls, "format", self.format, FORMATS)
        _choice(cls, "scales", self.scales, SCALE_LAYOUTS)
        _choice(cls, "nonfinite", self.nonfinite, NONFINITE_POLICIES)
        _choice(cls, "backend", self.backend, BACKENDS)
        for name in ("hadamard", "random_signs", "adaptive_scale"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{cls}.{name}={getattr(self, name)!r} must be True or False")
        seed = self.sign_seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise ValueError(f"{cls}.sign_seed={self.sign_seed!r} must be an int in [0, 2**64)")
        if self.random_signs and not self.hadamard:
            raise ValueError(
                f"{cls}.random_signs=True needs hadamard=True: the signs only randomise "
                "the Hadamard transform"
            )

    @property
    def codec(self) -> "CodecConfig":
        """The codec settings alone (this object for a `CodecConfig`)."""
        return self

    @property
    def qmax(self) -> float:
        """Largest magnitude of the payload format (448, 57344 or 127)."""
        return QMAX[self.format]

    @property
    def num_scales(self) -> int:
        """fp32 scales per group on the wire."""
        return 2 if self.scales == "dual" else 1

    @property
    def bytes_per_element(self) -> float:
        """Wire bytes per input element, scales included (each chunk's 4-byte header and its
        padding, at most 16 bytes a chunk, excluded)."""
        return 1.0 + 4.0 * self.num_scales / self.group_size

    def replace(self, **changes):
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict):
        if not isinstance(values, dict):
            raise TypeError(f"{cls.__name__}.from_dict expects a dict of field values, got {type(values).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(values) - fields
        if unknown:
            hint = ""
            if cls is CodecConfig and unknown <= {"threshold_bytes", "piece_bytes"}:
                hint = "; the size threshold and the piece size are collective policy: use TacoConfig.from_dict"
            raise ValueError(f"unknown {cls.__name__} fields {sorted(unknown)}{hint}")
        return cls(**values)


CODEC_FIELDS = tuple(f.name for f in dataclasses.fields(CodecConfig))


@dataclass(frozen=True)
class TacoConfig(CodecConfig):
    """Settings of a compressed collective: the codec's (every field of `CodecConfig`) and the
    collective policy, from what size a message is compressed and in what pieces. ``TacoConfig()``
    compresses every message.

    Args:
        threshold_bytes: an opt-in size floor: messages smaller than this go through the
            plain collective in their own dtype, wherever this config is used (a direct
            ``comm.all_reduce(x, config=...)``, a site of a `taco_accel.Compression` in any
            mode). Default 0: every message is compressed. Whether compression pays on a
            given link is the ``"auto"`` mode's question (`taco_accel.Compression`), not this
            field's.
        piece_bytes: the collectives split larger messages into pieces of about this size so
            that encoding one piece overlaps sending another; 0 disables the split. Default
            32 MiB, chosen with the cost model (``python -m taco_accel.bench.projection
            --pieces``; the reasoning is at `taco_accel.comm.pieces`).

    ``codec`` is the `CodecConfig` of the codec fields alone: what the codec and the wire see.
    """

    threshold_bytes: int = 0
    piece_bytes: int = PIECE_BYTES

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("threshold_bytes", "piece_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"TacoConfig.{name}={value!r} must be an int >= 0 (bytes)")
        object.__setattr__(self, "_codec", CodecConfig(**{name: getattr(self, name) for name in CODEC_FIELDS}))

    @property
    def codec(self) -> CodecConfig:
        """The codec settings alone (the fields of `CodecConfig`)."""
        return self._codec

    def compresses(self, nbytes: int) -> bool:
        """The size floor: whether a message of ``nbytes`` input bytes may be compressed (all
        but empty ones under the default ``threshold_bytes=0``)."""
        return nbytes >= self.threshold_bytes and nbytes > 0
