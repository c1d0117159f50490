"""Data-driven reshaping: pick the group size G from the tensors that actually flow."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from .api import compress, decompress
from .config import GROUP_SIZES, TacoConfig

# Errors below this are fp32 rounding of the transform, not quantisation (an fp8 step is ~1e-2
# relative): they count as equal, so that a lossless round trip's rounding noise (0 for one
# group size, 1e-7 for another) does not decide the group size.
ROUNDING_FLOOR = 1e-5


def relative_rms_error(x: torch.Tensor, config: TacoConfig | None = None) -> float:
    """``||decode(encode(x)) - x|| / ||x||`` in float64 (0.0 for an all-zero tensor)."""
    x64 = x.detach().double()
    err = (decompress(compress(x, config)).double() - x64).norm()
    ref = x64.norm()
    return 0.0 if ref == 0 else float(err / ref)


def _last_dim(t: torch.Tensor) -> int:
    """Length of the rows groups must not straddle (1 for a 0-d tensor)."""
    return t.shape[-1] if t.dim() else 1


def calibrate(
    samples: Iterable[torch.Tensor],
    candidates: Sequence[int] = GROUP_SIZES,
    config: TacoConfig | None = None,
    tolerance: float = 0.05,
) -> int:
    """The group size for a stream of tensors (``samples``) under ``config``'s other settings.

    Rule: measure the energy-weighted relative RMS error of a round trip for every candidate
    G (summed over all samples), then take the *largest* G whose error is within
    ``(1 + tolerance)`` of the smallest one (errors under `ROUNDING_FLOOR` count as equal).
    Larger groups cost fewer scale bytes (8/G bytes per element with dual scales, 4/G with a
    single one), so the rule buys bytes only where they cost at most ``tolerance`` of relative
    precision. Candidates that do not divide the last dimension of every sample are skipped
    when any candidate does (groups must not straddle rows); samples holding NaN or Inf are
    ignored.
    """
    config = config or TacoConfig()
    if tolerance < 0:
        raise ValueError(f"tolerance={tolerance} must be >= 0")
    bad = [g for g in candidates if g not in GROUP_SIZES]
    if bad or not candidates:
        raise ValueError(f"candidates {list(candidates)} must be a non-empty subset of {GROUP_SIZES}")
    tensors = [s.detach() for s in samples if s.numel() and bool(torch.isfinite(s).all())]
    if not tensors:
        raise ValueError("calibrate needs at least one non-empty, finite sample tensor")
    dividing = [g for g in candidates if all(_last_dim(t) % g == 0 for t in tensors)]
    pool = sorted(dividing or candidates)
    errors = {}
    for g in pool:
        cfg = config.replace(group_size=g)
        err2 = ref2 = 0.0
        for t in tensors:
            x64 = t.double()
            err2 += float((decompress(compress(t, cfg)).double() - x64).square().sum())
            ref2 += float(x64.square().sum())
        errors[g] = (err2 / ref2) ** 0.5 if ref2 else 0.0
    limit = max(min(errors.values()) * (1 + tolerance), ROUNDING_FLOOR)
    return max(g for g in pool if errors[g] <= limit)
