"""The per-group orthogonal transform: Sylvester Walsh-Hadamard with optional random signs.

Row-vector convention, one group per row: ``Y = X @ W / sqrt(G)`` encodes and
``X = Y @ W.T / sqrt(G)`` decodes, with ``W = D @ H_G`` (entries +-1, so ``W @ W.T = G * I``)
and D the diagonal of random signs (identity when they are off).

The reference codec applies W as butterflies (`walsh_hadamard`), not as a matrix product: a
BLAS sums a product in an order of its own (threads, instruction set, blocking), and forked
gloo ranks were seen to encode a tensor into other bytes than their parent process (a tie
rounded the other way). Butterflies are elementwise IEEE fp32: the same bits in every process
and on every machine, and G log G instead of G^2 operations per group.
"""

from __future__ import annotations

import functools

import torch

from .config import CodecConfig


@functools.lru_cache(maxsize=None)
def sign_vector(group_size: int, seed: int) -> torch.Tensor:
    """The fixed +-1 vector of the random-sign option; the same on every rank and machine."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (group_size,), generator=gen).float() * 2 - 1


def device_signs(config: CodecConfig, device: torch.device) -> torch.Tensor:
    """`sign_vector` of ``config`` on ``device``, copied there once (not on every call)."""
    return _device_signs(config.group_size, config.sign_seed, str(device))


@functools.lru_cache(maxsize=None)
def _device_signs(group_size: int, seed: int, device: str) -> torch.Tensor:
    return sign_vector(group_size, seed).to(device)


def walsh_hadamard(x: torch.Tensor) -> torch.Tensor:
    """``x @ H_G`` for the rows of ``x`` [n, G] (unnormalised, Sylvester order), by log2(G)
    stages of butterflies (``H_2m = [[H_m, H_m], [H_m, -H_m]]``), stride 1 first; fp32 in,
    fp32 out.

    The stages of stride 1, 2 and 4 pair neighbours inside blocks of 8; they run with those
    blocks' positions moved to the middle axis, where each butterfly adds and subtracts
    contiguous runs of G/8 values (faster on a CPU; the same operations, so the same bits)."""
    n, g = x.shape
    inner = min(8, g)
    t = x.view(n, g // inner, inner).transpose(1, 2).contiguous()  # (n, 8, G/8): [position in block, block]
    t = _butterflies(t, 1, inner)
    x = t.transpose(1, 2).reshape(n, g, 1)
    return _butterflies(x, inner, g).view(n, g)


def _butterflies(t: torch.Tensor, first: int, stop: int) -> torch.Tensor:
    """Butterfly stages of stride ``first``, 2 ``first``, ... below ``stop`` along axis 1 of
    ``t`` (n, L, m): index i pairs with i + stride in blocks of 2 strides, sum first."""
    n, length, m = t.shape
    half = first
    while half < stop:
        pairs = t.view(n, length // (2 * half), 2, half, m)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        t = torch.stack((a + b, a - b), dim=2).view(n, length, m)
        half *= 2
    return t
