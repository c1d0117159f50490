"""Communication sites: every TP collective has a stable name and its own codec settings.

A site (`comm.Site`) is named after the module that owns it plus the direction of the tensor it
moves: ``layers.3.mlp.down_proj/fwd`` (the forward all-reduce of a row-parallel output) or
``layers.3.self_attn/bwd`` (the backward all-reduce of the attention input gradient).
`Compression` (`comm.policy`) says which `TacoConfig` each site starts with, its size floor and
piece size, and whether the auto mode decides if it is used (`comm.autotune`); `SiteTable` holds the sites of one model with
their run-time state (its own `comm.Ledger`: statistics and agreement checks, and its own
`comm.autotune.AutoDecider`), and the data-driven reshaping: record what each site sends for a
few steps, pick its group size with `codec.calibrate`, print / save / load the choice.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist

from ..codec import calibrate
from ..codec.config import GROUP_SIZES
from ..comm import CommStats, Ledger, Site
from ..comm.autotune import AutoDecider
from ..comm.copies import SharesGroup
from ..comm.policy import Compression

logger = logging.getLogger(__name__)


class SiteTable(SharesGroup, Mapping[str, Site]):
    """The sites of one parallelised model, by name, in the order they were created, and their
    run-time state: ``ledger`` (statistics, error sampling and agreement checks of this model's
    sites only) and ``decider`` (the auto decisions and their shared timings).

    ``timed=False`` (an emulated model: no real group) makes auto sites decide by the auto
    mode's size rule (`comm.policy.UNTIMED_BYTES`). ``ledger``: record into this one (a
    model's data-parallel gradient sites join its TP sites' ledger) instead of a new one.
    `decisions` returns what each site does, for logs and run records; `pop_stats` this model's
    figures (`comm.pop_comm_stats` returns every model's).
    """

    def __init__(self, group, compression: Compression, timed: bool = True, ledger: Ledger | None = None) -> None:
        self.group = group
        self.compression = compression
        self.decider = AutoDecider(group, timed) if compression.mode == "auto" else None
        self.ledger = ledger if ledger is not None else Ledger()
        self._sites: dict[str, Site] = {}

    def site(self, name: str, group=None) -> Site:
        """The site called ``name``, created with its configured settings on first use; ``group``:
        its own process group instead of the table's (a pipeline boundary's two ranks)."""
        if name not in self._sites:
            config, auto = self.compression.rule_for(name)
            self._sites[name] = Site(name, self.group if group is None else group, config,
                                     self.decider if auto else None, self.ledger,
                                     threshold_bytes=self.compression.threshold_bytes,
                                     piece_bytes=self.compression.piece_bytes)
        return self._sites[name]

    def plain(self, name: str) -> Site:
        """A plain site of this model outside the table's compression rules (a bookkeeping sum:
        replicated gradients, the loss's log-sum-exps), recording into this table's ledger."""
        return Site(name, self.group, None, ledger=self.ledger)

    def pop_stats(self) -> dict[str, CommStats]:
        """This model's figures per site since the last pop (`comm.CommStats`); then reset them."""
        return self.ledger.pop()

    def decisions(self) -> dict[str, dict]:
        """``{site: Site.to_dict()}``: JSON-ready, in creation order (``compressed`` True / False,
        or None where it depends on the message size or an auto site has not run yet)."""
        return {name: site.to_dict() for name, site in self._sites.items()}

    def summary(self) -> str:
        """What the sites do, in a few words (the `parallelize` log line)."""
        sites = list(self._sites.values())
        count = {mode: sum(s.mode == mode for s in sites) for mode in ("auto", "on", "off")}
        floor = self.compression.threshold_bytes
        parts = []
        if count["auto"]:
            parts.append(f"{count['auto']} decided by timing in the first steps (auto)")
        if count["on"]:
            parts.append(f"{count['on']} compressed" + (f" from {floor / 2**20:g} MiB on" if floor else ""))
        parts.append(f"{count['off']} plain")
        return f"{len(sites)} communication sites: " + ", ".join(parts)

    def __getitem__(self, name: str) -> Site:
        return self._sites[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._sites)

    def __len__(self) -> int:
        return len(self._sites)

    # -- group sizes: print, save, load ---------------------------------------------------

    def group_sizes(self) -> dict[str, int]:
        """``{site: group size}`` for every site with codec settings (compressed, or may be)."""
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
        lines += [f"{n:<{width}}  {s.describe()}" for n, s in self._sites.items()]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"SiteTable({self.summary()})"

    # -- calibration ------------------------------------------------------------------------

    def start_recording(self, max_elements: int = 2**16) -> None:
        """Every compressed site keeps a sample of what it sends from now on."""
        for site in self._sites.values():
            site.start_recording(max_elements)

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
