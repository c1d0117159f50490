"""`TacoConfig`: every knob of the TACO codec and of the compressed collectives, validated once."""

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

# Largest finite magnitude of each payload format (E5M2 has its own bound: the original
# implementation clamps it to 448 too, which wastes two binades).
QMAX = {"e4m3": 448.0, "e5m2": 57344.0, "int8": 127.0}


def _choice(name: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"TacoConfig.{name}={value!r} is not supported; use one of {allowed}")


@dataclass(frozen=True)
class TacoConfig:
    """Settings of the TACO codec and of the collectives that use it.

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
        threshold_bytes: messages smaller than this go through the plain collective in their
            own dtype, where the codec would cost more than it saves. Default 8 MiB.
        piece_bytes: the collectives split larger messages into pieces of about this size so
            that encoding one piece overlaps sending another; 0 disables the split. Default
            32 MiB, chosen with the cost model (``python -m taco_accel.bench.projection
            --pieces``; the reasoning is at `taco_accel.comm.pieces`).
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
    threshold_bytes: int = 8 * 2**20
    piece_bytes: int = 32 * 2**20
    sign_seed: int = 0x7AC0

    def __post_init__(self) -> None:
        if (
            isinstance(self.group_size, bool)
            or not isinstance(self.group_size, int)
            or self.group_size not in GROUP_SIZES
        ):
            raise ValueError(
                f"TacoConfig.group_size={self.group_size!r} is not supported; use a power of "
                f"two in {GROUP_SIZES}"
            )
        _choice("format", self.format, FORMATS)
        _choice("scales", self.scales, SCALE_LAYOUTS)
        _choice("nonfinite", self.nonfinite, NONFINITE_POLICIES)
        _choice("backend", self.backend, BACKENDS)
        for name in ("hadamard", "random_signs", "adaptive_scale"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"TacoConfig.{name}={getattr(self, name)!r} must be True or False")
        for name in ("threshold_bytes", "piece_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"TacoConfig.{name}={value!r} must be an int >= 0 (bytes)")
        seed = self.sign_seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise ValueError(f"TacoConfig.sign_seed={self.sign_seed!r} must be an int in [0, 2**64)")
        if self.random_signs and not self.hadamard:
            raise ValueError(
                "TacoConfig.random_signs=True needs hadamard=True: the signs only randomise "
                "the Hadamard transform"
            )

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

    def replace(self, **changes) -> "TacoConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "TacoConfig":
        unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown TacoConfig fields {sorted(unknown)}")
        return cls(**values)
