"""The per-group orthogonal transform: Sylvester Walsh-Hadamard with optional random signs.

Row-vector convention, one group per row: ``Y = X @ W / sqrt(G)`` encodes and
``X = Y @ W.T / sqrt(G)`` decodes, with ``W = D @ H_G`` (entries +-1, so ``W @ W.T = G * I``)
and D the diagonal of random signs (identity when they are off).
"""

from __future__ import annotations

import functools

import torch

from .config import TacoConfig


@functools.lru_cache(maxsize=None)
def hadamard_matrix(n: int) -> torch.Tensor:
    """Sylvester's H_n (entries +-1, symmetric, H @ H = n * I), fp32 on the CPU."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size {n} must be a power of two")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@functools.lru_cache(maxsize=None)
def sign_vector(group_size: int, seed: int) -> torch.Tensor:
    """The fixed +-1 vector of the random-sign option; the same on every rank and machine."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (group_size,), generator=gen).float() * 2 - 1


@functools.lru_cache(maxsize=None)
def _transform_matrix_cpu(group_size: int, random_signs: bool, seed: int) -> torch.Tensor:
    h = hadamard_matrix(group_size)
    if random_signs:
        h = sign_vector(group_size, seed)[:, None] * h
    return h.contiguous()


_device_cache: dict[tuple, torch.Tensor] = {}


def transform_matrix(config: TacoConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """W of the module docstring for this config, fp32 on ``device`` (cached)."""
    key = (config.group_size, config.random_signs, config.sign_seed, str(device))
    w = _device_cache.get(key)
    if w is None:
        w = _transform_matrix_cpu(config.group_size, config.random_signs, config.sign_seed).to(device)
        _device_cache[key] = w
    return w
