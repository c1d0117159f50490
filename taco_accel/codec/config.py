"""`TacoConfig`: how the TACO codec encodes a tensor (group size, payload format, scales,
transform, non-finite policy, backend), validated once.

Codec settings only. Which messages are compressed (the modes off / on / auto, the size floor,
per-site overrides) and in what pieces a collective sends them is `taco_accel.Compression`'s
business (`comm.policy`), a layer above. ``CodecConfig`` is the same class under the codec
layer's name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import InitVar, dataclass
from typing import Literal

from ..errors import ConfigError

Format = Literal["e4m3", "e5m2", "int8"]
ScaleLayout = Literal["single", "dual"]
NonFinitePolicy = Literal["propagate", "raise", "zero"]
Backend = Literal["auto", "triton", "torch"]

FORMATS = ("e4m3", "e5m2", "int8")
SCALE_LAYOUTS = ("single", "dual")
NONFINITE_POLICIES = ("propagate", "raise", "zero")
BACKENDS = ("auto", "triton", "torch")
GROUP_SIZES = (32, 64, 128, 256, 512)
POLICY_FIELDS = ("threshold_bytes", "piece_bytes")  # moved to `Compression`: named by the errors


class _Moved:
    def __repr__(self) -> str:
        return "<moved to Compression>"


MOVED = _Moved()

# Largest finite magnitude of each payload format (E5M2 has its own bound: the original
# implementation clamps it to 448 too, which wastes two binades).
QMAX = {"e4m3": 448.0, "e5m2": 57344.0, "int8": 127.0}


def _choice(cls: str, name: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{cls}.{name}={value!r} is not supported; use one of {allowed}")


@dataclass(frozen=True)
class TacoConfig:
    """How the TACO codec encodes a tensor (no collective policy: see `taco_accel.Compression`).

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
    threshold_bytes: InitVar[object] = MOVED  # moved to Compression: passing one raises, naming it
    piece_bytes: InitVar[object] = MOVED

    def __post_init__(self, threshold_bytes: object = MOVED, piece_bytes: object = MOVED) -> None:
        cls = type(self).__name__
        for name, value in zip(POLICY_FIELDS, (threshold_bytes, piece_bytes)):
            if value is not MOVED:
                raise ConfigError(_moved(f"{cls}({name}={value!r})", name))
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
    def codec(self) -> "TacoConfig":
        """The codec settings: this object (a `TacoConfig` holds nothing else)."""
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
        moved = sorted(set(changes) & set(POLICY_FIELDS))
        if moved:
            raise ConfigError(_moved(f"{type(self).__name__}.replace({moved[0]}=...)", moved[0]))
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
            moved = sorted(unknown & set(POLICY_FIELDS))
            if moved:
                raise ConfigError(_moved(f"{cls.__name__} fields {moved}", moved[0]))
            raise ValueError(f"unknown {cls.__name__} fields {sorted(unknown)}")
        return cls(**values)


CodecConfig = TacoConfig  # the codec layer's name for the same class
CODEC_FIELDS = tuple(f.name for f in dataclasses.fields(TacoConfig))


def _moved(what: str, name: str) -> str:
    return (f"{what}: the size floor and the piece size are compression policy, not codec settings; pass "
            f"taco_accel.Compression(..., {name}=...) (the command line's --compression-threshold sets the floor)")
