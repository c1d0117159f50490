"""The TACO codec in plain PyTorch: the specification of the algorithm and the CPU path.

Per group x of G values, in fp32 (the README's "What the codec does" says where it departs
from the paper):

1. adaptive scale ``a = clamp(QMAX / sqrt(mean(x^2) + 1e-6), 1e-3, 1e3)`` ("dual" only);
2. transform ``y = a * (x @ W) / sqrt(G)`` (W: signs times Hadamard, applied as butterflies,
   see `hadamard`);
3. absmax scale ``s = max|y| / QMAX`` and payload ``q = round(clamp(y / s, -QMAX, QMAX))``
   in the payload format (round to nearest even, saturating).

Decode: ``x = ((q * s / a) @ W.T) / sqrt(G)``. With ``scales="single"`` the wire carries the
effective scale ``d = s / a`` only; `a` cancels algebraically, so it is never computed.

The two-shot all-reduce sums in the transformed domain: ``z = sum_p q_p * d_p`` is the
transform of the sum because the transform is linear and ``d_p`` is a per-group scalar;
`requantize` turns z into a payload again, with no transform in between.

Non-finite inputs: a group holding NaN or Inf gets a NaN scale (decodes to NaN) under
"propagate"; "zero" replaces those values by 0 first; "raise" is checked by the caller.
"""

from __future__ import annotations

import torch

from ..config import CodecConfig
from ..hadamard import device_signs, walsh_hadamard
from ..layout import PAYLOAD_DTYPES, WireLayout, signed_header

ADAPTIVE_EPS = 1e-6
ADAPTIVE_MIN, ADAPTIVE_MAX = 1e-3, 1e3
# Groups whose largest magnitude is below this decode to zero: qmax / amax must stay finite in
# fp32 for every format (57344 / 1e-33 = 5.7e37 < 3.4e38; at 1e-35 E5M2 overflowed to inf and
# saturated every value), and the scale amax / qmax stays a normal fp32 (>= 1.7e-38).
TINY_AMAX = 1e-33
# Decoded values go out saturated to fp16's largest finite value: a finite input near it comes
# back within the codec's error, which may lie past it, and must not decode to inf.
FP16_MAX = 65504.0


def divide(num: torch.Tensor | float, den: torch.Tensor | float) -> torch.Tensor:
    """``num / den`` rounded once, as the kernels divide (`tl.div_rn`), on every device. torch
    divides a Python number by a tensor as a product with the reciprocal (a quarter of fp32
    quotients one bit off on the CPU), and on CUDA a tensor by a Python number too."""
    like = num if isinstance(num, torch.Tensor) else den
    # a fill, not a copy from the host: the benchmark captures the reference in CUDA graphs
    num, den = (v if isinstance(v, torch.Tensor) else torch.full((), v, dtype=like.dtype, device=like.device)
                for v in (num, den))
    return torch.div(num, den)


def adaptive_scale(groups: torch.Tensor, qmax: float) -> torch.Tensor:
    """The paper's step 1 per row of ``groups`` [n, G]: ``clamp(qmax / rms, 1e-3, 1e3)``."""
    rms = torch.sqrt(groups.square().mean(dim=1) + ADAPTIVE_EPS)
    return divide(qmax, rms).clamp(ADAPTIVE_MIN, ADAPTIVE_MAX)


def quantize(values: torch.Tensor, fmt: str, qmax: float) -> torch.Tensor:
    """Round ``values`` (already scaled into [-qmax, qmax] up to rounding) to the payload dtype."""
    values = values.clamp(-qmax, qmax)  # torch's fp8 cast does not saturate everywhere
    if fmt == "int8":
        values = torch.round(values)  # half to even
    return values.to(PAYLOAD_DTYPES[fmt])


def requantize(z: torch.Tensor, bad: torch.Tensor, config: CodecConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Transformed-domain groups z [n, G] fp32 -> payload [n, G] and scales [num_scales, n].

    ``bad`` [n] marks groups that held a non-finite value: their scale becomes NaN.
    """
    qmax = config.qmax
    if config.scales == "dual":
        a = adaptive_scale(z, qmax) if config.adaptive_scale else torch.ones_like(z[:, 0])
        z = z * a[:, None]
    amax = z.abs().amax(dim=1)
    bad = bad | ~torch.isfinite(amax)  # also an fp32 overflow inside the transform
    big = amax >= TINY_AMAX
    s = torch.where(big, divide(amax, qmax), torch.zeros_like(amax))
    inv = torch.where(big & ~bad, divide(qmax, torch.where(big, amax, torch.ones_like(amax))), torch.zeros_like(amax))
    q = torch.where(bad[:, None], torch.zeros_like(z), z * inv[:, None])
    s = torch.where(bad, torch.full_like(s, float("nan")), s)
    if config.scales == "dual":
        a = torch.where(bad, torch.ones_like(a), a)
    scales = torch.stack([s, a]) if config.scales == "dual" else s[None]
    return quantize(q, config.format, qmax), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Payload [n, G] and scales [num_scales, n] -> transformed-domain groups [n, G] fp32."""
    effective = scales[0] / scales[1] if scales.shape[0] == 2 else scales[0]
    return q.float() * effective[:, None]


def encode_groups(groups: torch.Tensor, config: CodecConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Input groups [n, G] (any float dtype) -> payload [n, G] and scales [num_scales, n]."""
    x = groups.float()
    bad = ~torch.isfinite(x).all(dim=1)
    if config.nonfinite == "zero":
        x = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
        bad = torch.zeros_like(bad)
    if config.hadamard:
        x = walsh_hadamard(x * device_signs(config, x.device) if config.random_signs else x) * config.group_size**-0.5
    return requantize(x, bad, config)


def decode_groups(q: torch.Tensor, scales: torch.Tensor, config: CodecConfig) -> torch.Tensor:
    """Payload [n, G] and scales [num_scales, n] -> decoded groups [n, G] fp32."""
    z = dequantize(q, scales)
    if config.hadamard:  # W.T = H D: the butterflies, then the signs
        z = walsh_hadamard(z) * config.group_size**-0.5
        if config.random_signs:
            z = z * device_signs(config, z.device)
    return z


# --- the backend interface shared with the Triton kernels -------------------------------------


def compress_into(x: torch.Tensor, buffer: torch.Tensor, layout: WireLayout, config: CodecConfig) -> None:
    """Encode the flat tensor ``x`` into ``buffer`` (uint8, ``layout.total_bytes``)."""
    flat = torch.zeros(layout.padded_numel, dtype=torch.float32, device=x.device)
    flat[: layout.numel] = x.reshape(-1)
    q, scales = encode_groups(flat.view(-1, layout.group_size), config)
    _store(buffer, layout, config, q, scales)


def _store(buffer: torch.Tensor, layout: WireLayout, config: CodecConfig, q: torch.Tensor, scales: torch.Tensor) -> None:
    chunks, gpc = layout.chunks, layout.groups_per_chunk
    layout.payload(buffer, config.format).copy_(q.view(chunks, -1))
    layout.scales(buffer).copy_(scales.view(-1, chunks, gpc).transpose(0, 1))
    layout.headers(buffer).fill_(signed_header(config))
    layout.padding(buffer).zero_()


def _unpack(buffer: torch.Tensor, layout: WireLayout, config: CodecConfig):
    q = layout.payload(buffer, config.format).reshape(-1, layout.group_size)
    scales = layout.scales(buffer).transpose(0, 1).reshape(layout.num_scales, -1)
    return q, scales


def decompress_into(buffer: torch.Tensor, layout: WireLayout, config: CodecConfig, out: torch.Tensor) -> None:
    """Decode ``buffer`` into the flat tensor ``out`` (``layout.numel`` values, any float dtype)."""
    q, scales = _unpack(buffer, layout, config)
    decoded = decode_groups(q, scales, config).view(-1)[: layout.numel]
    if out.dtype == torch.float16:
        decoded = decoded.clamp(-FP16_MAX, FP16_MAX)  # NaN stays NaN
    out.copy_(decoded)


def sum_into(stacked: torch.Tensor, layout: WireLayout, config: CodecConfig, out: torch.Tensor) -> None:
    """Dequantise, sum and requantise P packed tensors of one layout, in the transformed domain.

    ``stacked`` is [P, layout.total_bytes] uint8; ``out`` receives one buffer of that layout.
    """
    z = None
    bad = None
    for p in range(stacked.shape[0]):
        q, scales = _unpack(stacked[p], layout, config)
        part = dequantize(q, scales)
        z = part if z is None else z + part
        nan = torch.isnan(scales).any(dim=0)
        bad = nan if bad is None else bad | nan
    q, scales = requantize(z, bad, config)
    _store(out, layout, config, q, scales)
