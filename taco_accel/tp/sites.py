"""Communication sites: every TP collective has a stable name and its own codec settings.

A site is named after the module that owns it plus the direction of the tensor it moves:
``layers.3.mlp.down_proj/fwd`` (the forward all-reduce of a row-parallel output) or
``layers.3.self_attn/bwd`` (the backward all-reduce of the attention input gradient).
`Compression` says which `TacoConfig` each site starts with (per direction, then per-site
patterns) and whether timing decides if it is used (the auto mode, `taco_accel.tp.auto`);
`SiteTable` holds the sites of one model, their decisions, and the data-driven reshaping:
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

from .. import comm
from ..codec import TacoConfig, calibrate
from ..codec.config import GROUP_SIZES
from ..comm import ops as comm_ops
from ..comm.dist_ops import group_size
from .auto import AutoDecider

logger = logging.getLogger(__name__)

DIRECTIONS = ("fwd", "bwd")


DEFAULT = TacoConfig()  # the codec's defaults, the collectives' piece size among them
ON = DEFAULT.replace(threshold_bytes=0)  # "on": every message of every site compressed
MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class Compression:
    """Which codec settings each site gets; ``None`` anywhere means the plain collective.

    Args:
        forward: settings of the forward sites (activations: row-parallel outputs, the
            embedding, sequence-parallel all-gathers). Default ``DEFAULT``: ``TacoConfig()``
            with pieces of `comm.pieces.PIECE_BYTES` (`TacoConfig`'s default).
        backward: settings of the backward sites (input gradients of column-parallel
            regions, sequence-parallel reduce-scatters). Default ``DEFAULT``.
        sites: per-site overrides, ``{pattern: TacoConfig | None}`` with shell-style
            patterns on site names, e.g. ``{"lm_head/*": None, "layers.0.*": cfg}``. When
            several patterns match, the last one wins.
        auto: decide per site from timings on the real group (`taco_accel.tp.auto`): a
            forward / backward site with settings is compressed only where the compressed
            collective measured faster than the plain one at that site's message, the same
            decision on every rank. Explicit choices still win: a direction set to ``None`` stays
            plain, and a site matched by ``sites`` follows its pattern (a `TacoConfig` there is
            compressed by its size threshold, ``None`` plain), untimed.

    `resolve` also takes the strings ``"auto"`` (the default of `parallelize`: ``auto=True``
    with ``DEFAULT``), ``"on"`` (every message compressed: ``DEFAULT`` with ``threshold_bytes=0``)
    and ``"off"`` (plain TP).
    """

    forward: TacoConfig | None = DEFAULT
    backward: TacoConfig | None = DEFAULT
    sites: Mapping[str, TacoConfig | None] = field(default_factory=dict)
    auto: bool = False

    def __post_init__(self) -> None:
        for name in ("forward", "backward"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, TacoConfig):
                raise ValueError(f"Compression.{name}={value!r} must be a TacoConfig or None")
        for pattern, value in self.sites.items():
            if value is not None and not isinstance(value, TacoConfig):
                raise ValueError(f"Compression.sites[{pattern!r}]={value!r} must be a TacoConfig or None")
        if not isinstance(self.auto, bool):
            raise ValueError(f"Compression.auto={self.auto!r} must be True or False")

    @classmethod
    def resolve(cls, value) -> "Compression":
        """Accept a `Compression`, ``"auto"`` / ``"on"`` / ``"off"``, a `TacoConfig` (both
        directions, compressed by its size threshold), ``None`` (plain TP) or a dict
        ``{"forward": cfg, "backward": cfg, "sites": {...}, "auto": bool}``."""
        if isinstance(value, Compression):
            return value
        if isinstance(value, str) and value in MODES:
            return {"auto": cls(auto=True), "on": cls(ON, ON), "off": cls(None, None)}[value]
        if value is None or isinstance(value, TacoConfig):
            return cls(forward=value, backward=value)
        if isinstance(value, Mapping):
            unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise ValueError(
                    f"compression dict has unknown keys {sorted(unknown)}; use 'forward', "
                    "'backward', 'sites' and 'auto'"
                )
            return cls(**value)
        raise ValueError(
            f"compression={value!r} is not supported; pass 'auto', 'on', 'off', a TacoConfig, None, "
            "a taco_accel.Compression or a dict {'forward': cfg|None, 'backward': cfg|None}"
        )

    def config_for(self, site: str) -> TacoConfig | None:
        return self.rule_for(site)[0]

    def rule_for(self, site: str) -> tuple[TacoConfig | None, bool]:
        """``(settings, decided by timing?)`` of the site called ``site``."""
        config, auto = (self.forward if site.endswith("/fwd") else self.backward), self.auto
        for pattern, override in self.sites.items():
            if fnmatch.fnmatchcase(site, pattern):
                config, auto = override, False
        return config, auto and config is not None

    def to_dict(self) -> dict:
        """JSON-ready values (a run record); `resolve` accepts them back after
        ``TacoConfig.from_dict`` on each config."""
        conf = lambda c: None if c is None else c.to_dict()  # noqa: E731
        return {"forward": conf(self.forward), "backward": conf(self.backward),
                "sites": {p: conf(c) for p, c in self.sites.items()}, "auto": self.auto}


class Site:
    """One communication site: its name, process group and current codec settings.

    ``config`` is mutable on purpose: calibration and `SiteTable.load` change the group size
    of a running model. `observe` keeps a small sample of what the site sends while a
    calibration records. With a ``decider`` (the auto mode) ``config`` is the candidate and
    the site is plain or compressed by its ``decision`` (None until its first call);
    `call_config` is what a collective of this site must use.
    """

    __slots__ = ("name", "group", "world", "handle", "_config", "decider", "decision", "samples", "_max_elements",
                 "_call", "__weakref__")

    def __init__(self, name: str, group, config: TacoConfig | None, decider=None) -> None:
        self.name, self.group, self.decider, self.decision = name, group, decider, None
        self.world = group_size(group)
        self.handle = comm_ops.register(self)  # how the compiled graph's custom ops find this site
        self.config = config
        self.samples: list[torch.Tensor] | None = None  # a list only while calibrating
        self._max_elements = 0
        if decider is not None:
            decider.sites.append(self)

    def collective(self, kind: str, x: torch.Tensor) -> torch.Tensor:
        """Send ``x`` through the collective ``kind`` ("all_reduce", "all_gather",
        "reduce_scatter") from this site: `run`, or inside torch.compile the custom op that
        calls `run` at run time (`comm.ops`: the collective stays in the graph)."""
        if torch.compiler.is_compiling():
            if kind == "all_reduce":
                return torch.ops.taco.all_reduce(x, self.handle)
            return comm_ops.OPS[kind](x, self.handle, self.world)
        return self.run(kind, x)

    def run(self, kind: str, x: torch.Tensor) -> torch.Tensor:
        """The collective, eagerly: calibration sample, settings (the auto decision), statistics."""
        self.observe(x)
        return getattr(comm, kind)(x, self.group, self.call_config(kind, x), site=self.name)

    @property
    def config(self) -> TacoConfig | None:
        return self._config

    @config.setter
    def config(self, value: TacoConfig | None) -> None:
        self._config = value
        self._call = value if self.decider is None else _decided(value, self.decision)

    def call_config(self, kind: str, x: torch.Tensor) -> TacoConfig | None:
        """The settings for sending ``x`` through the collective ``kind`` from this site.

        In auto mode the first call (and a call with a message over twice the one timed) decides;
        timing is a collective call, which every rank makes at the same site in the same order.
        """
        return self._settings(kind, x.numel() * x.element_size(), lambda: x)

    def call_config_like(self, kind: str, shape, dtype: torch.dtype, device) -> TacoConfig | None:
        """`call_config` for a message of ``shape`` and ``dtype`` that is sent in parts (the
        decomposed collectives); a timing, if one is due, runs on zeros of that shape."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        return self._settings(kind, nbytes, lambda: torch.zeros(shape, dtype=dtype, device=device))

    def _settings(self, kind: str, nbytes: int, message) -> TacoConfig | None:
        if self.decider is None:
            return self._call
        decision = self.decision
        if decision is None or nbytes > 2 * decision.nbytes:
            self.decision = self.decider.decide(self, kind, message())
            self._call = _decided(self._config, self.decision)
            self.decider.decided()
        return self._call

    def observe(self, x: torch.Tensor) -> None:
        """Keep evenly spaced rows of ``x`` (at most ``max_elements`` values) for calibration."""
        if self.samples is None or self.config is None or x.numel() == 0:
            return
        rows = x.detach().reshape(-1, x.shape[-1])
        keep = max(1, min(rows.shape[0], self._max_elements // max(1, rows.shape[1])))
        pick = torch.linspace(0, rows.shape[0] - 1, keep, device=rows.device).long()
        self.samples.append(rows[pick].float())

    @property
    def mode(self) -> str:
        """``"auto"``, ``"off"`` (plain), ``"on"`` (every message) or ``"size"`` (messages from
        ``config.threshold_bytes`` on)."""
        if self.decider is not None:
            return "auto"
        if self.config is None:
            return "off"
        return "on" if self.config.threshold_bytes == 0 else "size"

    def describe(self) -> str:
        """One line: the codec and whether it is used."""
        codec, mode = describe(self.config), self.mode
        if mode == "auto":
            return f"{codec}, auto: {'undecided' if self.decision is None else self.decision}"
        if mode == "size":
            return f"{codec}, messages from {self.config.threshold_bytes / 2**20:g} MiB"
        return codec

    def record(self) -> dict:
        """JSON-ready: mode, codec settings, and the auto decision (``compressed`` None: not yet)."""
        out = {"mode": self.mode, "config": None if self.config is None else self.config.to_dict()}
        if self.decider is not None:
            out["compressed"] = None if self.decision is None else self.decision.compress
            out["decision"] = None if self.decision is None else self.decision.to_dict()
        else:
            out["compressed"] = {"off": False, "on": True, "size": None}[self.mode]
        return out

    def __repr__(self) -> str:
        return f"Site({self.name!r}, {self.describe()})"


def _decided(config: TacoConfig | None, decision) -> TacoConfig | None:
    """The settings a decided auto site sends with: compressed from the timed size on, or
    plain (the codec settings kept for their non-finite policy, the threshold out of reach)."""
    if config is None or decision is None:
        return None
    if decision.compress:
        return config.replace(threshold_bytes=min(config.threshold_bytes, decision.nbytes))
    return config.replace(threshold_bytes=NEVER)


NEVER = 2**62  # a threshold no message reaches


def describe(config: TacoConfig | None) -> str:
    return "plain" if config is None else f"{config.format} G={config.group_size}"


class SiteTable(Mapping[str, Site]):
    """The sites of one parallelised model, by name, in the order they were created.

    ``timed=False`` (an emulated model: no real group) makes auto sites decide by size.
    `decisions` returns what each site does, for logs and run records.
    """

    def __init__(self, group, compression: Compression, timed: bool = True) -> None:
        self.group = group
        self.compression = compression
        self.decider = AutoDecider(group, timed) if compression.auto else None
        self._sites: dict[str, Site] = {}

    def site(self, name: str) -> Site:
        """The site called ``name``, created with its configured settings on first use."""
        if name not in self._sites:
            config, auto = self.compression.rule_for(name)
            self._sites[name] = Site(name, self.group, config, self.decider if auto else None)
        return self._sites[name]

    def decisions(self) -> dict[str, dict]:
        """``{site: Site.record()}``: JSON-ready, in creation order (``compressed`` True / False,
        or None where it depends on the message size or an auto site has not run yet)."""
        return {name: site.record() for name, site in self._sites.items()}

    def summary(self) -> str:
        """What the sites do, in a few words (the `parallelize` log line)."""
        sites = list(self._sites.values())
        count = {mode: sum(s.mode == mode for s in sites) for mode in ("auto", "on", "size", "off")}
        parts = []
        if count["auto"]:
            parts.append(f"{count['auto']} decided by timing in the first steps (auto)")
        if count["on"]:
            parts.append(f"{count['on']} compressed")
        if count["size"]:
            sizes = sorted({s.config.threshold_bytes / 2**20 for s in sites if s.mode == "size"})
            parts.append(f"{count['size']} compressed from {'/'.join(f'{b:g}' for b in sizes)} MiB on")
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
