"""Communication sites: every TP collective has a stable name and its own codec settings.

A site is named after the module that owns it plus the direction of the tensor it moves:
``layers.3.mlp.down_proj/fwd`` (the forward all-reduce of a row-parallel output) or
``layers.3.self_attn/bwd`` (the backward all-reduce of the attention input gradient).
`Compression` says which `TacoConfig` each site starts with (per direction, then per-site
patterns); `SiteTable` holds the sites of one model and carries the data-driven reshaping:
record what each site sends for a few steps, pick its group size with `codec.calibrate`,
print / save / load the choice.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..codec import TacoConfig, calibrate
from ..codec.config import GROUP_SIZES

logger = logging.getLogger(__name__)

DIRECTIONS = ("fwd", "bwd")


@dataclass(frozen=True)
class Compression:
    """Which codec settings each site gets; ``None`` anywhere means the plain collective.

    Args:
        forward: settings of the forward sites (activations: row-parallel outputs, the
            embedding, sequence-parallel all-gathers). Default ``TacoConfig()``.
        backward: settings of the backward sites (input gradients of column-parallel
            regions, sequence-parallel reduce-scatters). Default ``TacoConfig()``.
        sites: per-site overrides, ``{pattern: TacoConfig | None}`` with shell-style
            patterns on site names, e.g. ``{"lm_head/*": None, "layers.0.*": cfg}``. When
            several patterns match, the last one wins.
    """

    forward: TacoConfig | None = TacoConfig()
    backward: TacoConfig | None = TacoConfig()
    sites: Mapping[str, TacoConfig | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("forward", "backward"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, TacoConfig):
                raise ValueError(f"Compression.{name}={value!r} must be a TacoConfig or None")
        for pattern, value in self.sites.items():
            if value is not None and not isinstance(value, TacoConfig):
                raise ValueError(f"Compression.sites[{pattern!r}]={value!r} must be a TacoConfig or None")

    @classmethod
    def resolve(cls, value) -> "Compression":
        """Accept a `Compression`, a `TacoConfig` (both directions), ``None`` (plain TP) or a
        dict ``{"forward": cfg, "backward": cfg, "sites": {...}}``."""
        if isinstance(value, Compression):
            return value
        if value is None or isinstance(value, TacoConfig):
            return cls(forward=value, backward=value)
        if isinstance(value, Mapping):
            unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise ValueError(
                    f"compression dict has unknown keys {sorted(unknown)}; use 'forward', "
                    "'backward' and 'sites'"
                )
            return cls(**value)
        raise ValueError(
            f"compression={value!r} is not supported; pass a TacoConfig, None, a "
            "taco_accel.Compression or a dict {'forward': cfg|None, 'backward': cfg|None}"
        )

    def config_for(self, site: str) -> TacoConfig | None:
        config = self.forward if site.endswith("/fwd") else self.backward
        for pattern, override in self.sites.items():
            if fnmatch.fnmatchcase(site, pattern):
                config = override
        return config


class Site:
    """One communication site: its name, process group and current codec settings.

    ``config`` is mutable on purpose: calibration and `SiteTable.load` change the group size
    of a running model. `observe` keeps a small sample of what the site sends while a
    calibration records.
    """

    __slots__ = ("name", "group", "config", "samples", "_max_elements")

    def __init__(self, name: str, group, config: TacoConfig | None) -> None:
        self.name, self.group, self.config = name, group, config
        self.samples: list[torch.Tensor] | None = None  # a list only while calibrating
        self._max_elements = 0

    def observe(self, x: torch.Tensor) -> None:
        """Keep evenly spaced rows of ``x`` (at most ``max_elements`` values) for calibration."""
        if self.samples is None or self.config is None or x.numel() == 0:
            return
        rows = x.detach().reshape(-1, x.shape[-1])
        keep = max(1, min(rows.shape[0], self._max_elements // max(1, rows.shape[1])))
        pick = torch.linspace(0, rows.shape[0] - 1, keep, device=rows.device).long()
        self.samples.append(rows[pick].float())

    def __repr__(self) -> str:
        return f"Site({self.name!r}, {describe(self.config)})"


def describe(config: TacoConfig | None) -> str:
    return "plain" if config is None else f"{config.format} G={config.group_size}"


class SiteTable(Mapping[str, Site]):
    """The sites of one parallelised model, by name, in the order they were created."""

    def __init__(self, group, compression: Compression) -> None:
        self.group = group
        self.compression = compression
        self._sites: dict[str, Site] = {}

    def site(self, name: str) -> Site:
        """The site called ``name``, created with its configured settings on first use."""
        if name not in self._sites:
            self._sites[name] = Site(name, self.group, self.compression.config_for(name))
        return self._sites[name]

    def __getitem__(self, name: str) -> Site:
        return self._sites[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._sites)

    def __len__(self) -> int:
        return len(self._sites)

    # -- group sizes: print, save, load ---------------------------------------------------

    def group_sizes(self) -> dict[str, int]:
        """``{site: group size}`` for every compressed site."""
        return {n: s.config.group_size for n, s in self._sites.items() if s.config is not None}

    def set_group_sizes(self, sizes: Mapping[str, int]) -> None:
        unknown = sorted(set(sizes) - set(self._sites))
        if unknown:
            raise ValueError(f"unknown sites {unknown[:5]}; this model has e.g. {list(self._sites)[:3]}")
        for name, size in sizes.items():
            site = self._sites[name]
            if site.config is None:
                raise ValueError(f"site {name!r} is not compressed, so it has no group size")
            site.config = site.config.replace(group_size=int(size))

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump({"group_sizes": self.group_sizes()}, f, indent=1, sort_keys=True)

    def load(self, path: str | os.PathLike) -> None:
        with open(path) as f:
            self.set_group_sizes(json.load(f)["group_sizes"])

    def __str__(self) -> str:
        width = max((len(n) for n in self._sites), default=4)
        lines = [f"{'site':<{width}}  codec"]
        lines += [f"{n:<{width}}  {describe(s.config)}" for n, s in self._sites.items()]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"SiteTable({len(self)} sites, {len(self.group_sizes())} compressed)"

    # -- calibration ------------------------------------------------------------------------

    def start_recording(self, max_elements: int = 2**16) -> None:
        """Every compressed site keeps a sample of what it sends from now on."""
        for site in self._sites.values():
            site.samples, site._max_elements = [], max_elements

    def stop_recording(self) -> None:
        for site in self._sites.values():
            site.samples = None

    def calibrate(self, candidates=GROUP_SIZES, tolerance: float = 0.05) -> dict[str, int]:
        """Pick each recorded site's group size with `codec.calibrate`, apply it, stop recording.

        Ranks send different tensors through one site, so each rank picks on its own data and
        the group then takes the smallest (most precise) choice: every rank of a collective
        must use the same wire layout. A collective call (every rank of the group calls it).
        """
        names = list(self._sites)
        picked = []
        for name in names:
            site = self._sites[name]
            samples = site.samples or []
            big = 1 << 30  # "no data here": another rank may have some
            usable = site.config is not None and any(s.numel() and bool(torch.isfinite(s).all()) for s in samples)
            picked.append(calibrate(samples, candidates, site.config, tolerance) if usable else big)
        choice = torch.tensor(picked, dtype=torch.int64)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            if dist.get_backend(self.group) == "nccl":
                choice = choice.cuda()
            dist.all_reduce(choice, op=dist.ReduceOp.MIN, group=self.group)
        chosen = {n: int(g) for n, g in zip(names, choice.tolist()) if g != big}
        self.stop_recording()
        self.set_group_sizes(chosen)
        logger.info("calibrated the group size of %d sites: %s", len(chosen), chosen)
        return chosen
