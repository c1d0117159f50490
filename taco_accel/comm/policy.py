"""`Compression`: the one owner of compression policy, for every communication site of a model:
tensor-parallel collectives, pipeline boundaries and data-parallel gradient reductions.

It holds the mode (off / on / auto), the codec settings per direction and per-site overrides,
the size floor and the piece size; `TacoConfig` holds codec settings only. One value says it at
every public entry (`parallelize`, `from_pretrained`, `distribute`, `apply_tp`, `apply_pp`,
`emulate_boundaries`, `Accelerator`, `taco_trainer`, `TrainConfig`, `FinetuneConfig` and the
command lines' ``--compression``), each of which passes what it is given through
`Compression.resolve`, and each of which defaults to `DEFAULT_COMPRESSION` (``"auto"``)::

    Compression(mode="on", forward=TacoConfig(group_size=64), backward=None,
                sites={"lm_head/*": None})          # every forward site but the lm head's, compressed
    Compression("on", threshold_bytes=2**20)       # every site, messages from 1 MiB on
    Compression.resolve("auto")                    # = Compression(): the default
    Compression.from_json("compression.json")      # {"mode": ..., "forward": {...}, ...}

What a site (`comm.Site`, named like ``layers.3.mlp.down_proj/fwd``; a pipeline stage boundary's
are ``pp.<b>-<b+1>/fwd`` and ``/bwd``, a data-parallel gradient's ``dp.grad.<bucket>/...``)
does:

- ``mode="off"``: every site plain (the overrides in ``sites`` too).
- ``mode="on"``: every site with codec settings compressed, every message: its direction's
  settings (``forward`` for ``*/fwd`` sites, ``backward`` for every other: ``*/bwd`` and the
  gradient reductions), or those of the last pattern of ``sites`` that matches its name.
  ``None`` for a direction or a pattern keeps those sites plain.
- ``mode="auto"``: a site with its direction's settings is compressed only where the compressed
  collective measured faster than the plain one at that site's message on the real group (its
  first call; the same decision on every rank: `comm.autotune`). Where there is no group to
  time (an emulated model, `parallel.emulate_boundaries`), the auto mode is this size rule
  instead: messages from `UNTIMED_BYTES` (8 MiB) on are compressed. A site matched by
  ``sites`` follows its pattern, untimed: a `TacoConfig` compresses, ``None`` keeps it plain.

In every mode ``threshold_bytes`` (default 0) is an opt-in floor: messages smaller than it stay
plain, untimed. A compressed message is sent in pieces of about ``piece_bytes`` (0: whole) whose
codec work overlaps the transfer of their neighbours (`comm.pieces`).

A model keeps the compression it was parallelised with (``model.taco.compression``): an entry
that lays out a model already parallelised (`distribute`, `apply_pp`, `Accelerator.prepare`)
accepts the default (nothing given) or an equal value, and raises a `ConfigError` naming both
for a different one (`check_same`).

Group sizes are taken as given (a group may straddle rows of a narrow model: it works, with
coarser scales); `Compression.fit` lowers them to a model's hidden size where that is below
128, and the command lines apply it unless ``--group-size`` is given.
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, field, fields, replace
from typing import Literal, Union

from ..codec import TacoConfig
from ..codec.config import MOVED
from ..errors import ConfigError, ConfigTypeError
from .pieces import PIECE_BYTES

Mode = Literal["auto", "on", "off"]
MODES = ("auto", "on", "off")
DEFAULT_MODE: Mode = "auto"  # the default mode, of `Compression()` and of every public entry's compression


class _Default(str):
    """The type of `DEFAULT_COMPRESSION`: the string ``"auto"``, told apart from an ``"auto"``
    a caller passes, so that a model already parallelised keeps its own compression."""

    __slots__ = ()


DEFAULT_COMPRESSION: str = _Default(DEFAULT_MODE)  # every public entry's default ``compression``
UNTIMED_BYTES = 8 * 2**20  # "auto" with no group to time (emulated): compressed from this message size on
DEFAULT = TacoConfig()  # the codec's defaults
POLICY = ("threshold_bytes", "piece_bytes")
KEYS = ("mode", "forward", "backward", "sites", *POLICY)
CONFIG_FIELDS = frozenset(f.name for f in fields(TacoConfig))
FORMS = ("a taco_accel.Compression, 'auto', 'on', 'off', a TacoConfig (on, both directions), None (off), "
         "a dict (Compression.from_dict) or the path of a JSON file (a str ending in .json, or a pathlib.Path)")
DICT_HELP = ("a compression dict has 'mode' ('auto', 'on' or 'off'), 'forward' and 'backward' (a dict of "
             "TacoConfig fields, or null for plain), 'sites' ({pattern: TacoConfig fields or null}), "
             "'threshold_bytes' and 'piece_bytes'; or it is a dict of TacoConfig fields alone (mode 'on' with "
             "them both ways, with 'threshold_bytes' / 'piece_bytes' if given)")


@dataclass(frozen=True)
class Compression:
    """Whether and how each communication site of a model is compressed (see the module docstring).

    Args:
        mode: ``"auto"`` (default: compressed where timing on the real group says it pays),
            ``"on"`` (every site with settings, every message) or ``"off"`` (every site plain).
        forward: codec settings of the forward sites (activations: row-parallel outputs, the
            embedding, sequence-parallel all-gathers), or ``None`` to keep them plain. Default
            ``TacoConfig()``.
        backward: the same for the backward sites (input gradients of column-parallel
            regions, sequence-parallel reduce-scatters). Default ``TacoConfig()``.
        sites: per-site overrides ``{pattern: TacoConfig | None}``, shell-style patterns on
            site names (``{"lm_head/*": None, "layers.0.*": cfg}``); the last matching pattern
            wins, and a matched site is never timed.
        threshold_bytes: the size floor: messages smaller than this stay plain, untimed, in
            every mode. Default 0 (every message may be compressed). Whether compression pays
            on a given link is the ``"auto"`` mode's question, not this field's.
        piece_bytes: compressed messages larger than this are sent in pieces of about this
            size so that encoding one piece overlaps sending another; 0 disables the split.
            Default `comm.pieces.PIECE_BYTES` (32 MiB, chosen with ``python -m
            taco_accel.bench.projection --pieces``).

    Validated when built: a wrong type raises `ConfigTypeError` (a TypeError), a wrong value
    `ConfigError` (a ValueError), each quoting it.
    """

    mode: Mode = DEFAULT_MODE
    forward: TacoConfig | None = DEFAULT
    backward: TacoConfig | None = DEFAULT
    sites: Mapping[str, TacoConfig | None] = field(default_factory=dict)
    threshold_bytes: int = 0
    piece_bytes: int = PIECE_BYTES
    auto: InitVar[object] = MOVED  # removed: passing it raises, naming ``mode``
    defaulted: bool = field(default=False, init=False, compare=False, repr=False)  # resolved from the default

    def __post_init__(self, auto: object = MOVED) -> None:
        if auto is not MOVED:
            raise ConfigError(f"Compression(auto={auto!r}) was removed: pass mode='auto' (timed per site) or "
                              "mode='on' (every message)")
        if not isinstance(self.mode, str) or self.mode not in MODES:
            raise ConfigError(f"Compression.mode={self.mode!r} is not supported; use one of {MODES}")
        for name in ("forward", "backward"):
            _check_config(f"Compression.{name}", getattr(self, name))
        if not isinstance(self.sites, Mapping):
            raise ConfigTypeError(f"Compression.sites={self.sites!r} must be a dict {{pattern: TacoConfig | None}}")
        for pattern, value in self.sites.items():
            if not isinstance(pattern, str):
                raise ConfigTypeError(f"Compression.sites key {pattern!r} must be a str pattern on site names, "
                                      "e.g. 'lm_head/*'")
            _check_config(f"Compression.sites[{pattern!r}]", value)
        for name in POLICY:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"Compression.{name}={value!r} must be an int >= 0 (bytes)")
        object.__setattr__(self, "sites", dict(self.sites))  # the caller's dict may change later

    # -- the one entry ------------------------------------------------------------------------

    @classmethod
    def resolve(cls, value: object = DEFAULT_COMPRESSION) -> "Compression":
        """The `Compression` that ``value`` says: a `Compression` (as it is), ``"auto"`` /
        ``"on"`` / ``"off"`` (that mode, default settings), a `TacoConfig` (``"on"`` with it both
        ways), ``None`` (``"off"``), a dict (`from_dict`), or a path to a JSON file (a str
        ending in ``.json`` or a ``pathlib.Path``: `from_json`). Anything else raises
        `ConfigTypeError` naming these forms. `DEFAULT_COMPRESSION` (an entry's default) gives
        ``Compression()`` marked ``defaulted`` (nothing was given: `check_same`)."""
        if value is DEFAULT_COMPRESSION:
            default = cls(DEFAULT_MODE)
            object.__setattr__(default, "defaulted", True)
            return default
        if isinstance(value, Compression):
            return value
        if value is None:
            return cls("off")
        if isinstance(value, TacoConfig):
            return cls("on", value, value)
        if isinstance(value, str):
            if value in MODES:
                return cls(value)
            if value.endswith(".json"):
                return cls.from_json(value)
            raise ConfigError(f"compression={value!r} is not supported; pass 'auto', 'on', 'off' or the path of a "
                              ".json file")
        if isinstance(value, os.PathLike):
            return cls.from_json(value)
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        hint = ""
        if isinstance(value, bool):
            hint = "; for a switch, pass 'on' or 'off'"
        raise ConfigTypeError(f"compression={value!r} ({type(value).__name__}) is not supported; pass {FORMS}{hint}")

    # -- what a site does ---------------------------------------------------------------------

    def rule_for(self, site: str) -> tuple[TacoConfig | None, bool]:
        """``(settings, decided by the auto mode?)`` of the site called ``site``: settings None
        is plain; otherwise compressed (from ``threshold_bytes`` on), or, when the second value
        is True, where the auto decision says so."""
        if self.mode == "off":
            return None, False
        config, timed = (self.forward if site.endswith("/fwd") else self.backward), self.mode == "auto"
        for pattern, override in self.sites.items():
            if fnmatch.fnmatchcase(site, pattern):
                config, timed = override, False
        return config, timed and config is not None

    def map_configs(self, change) -> "Compression":
        """A copy with ``change(config)`` in place of every `TacoConfig` it holds (both
        directions and every site pattern; ``None`` stays plain): e.g. a command line's
        ``--group-size`` applied over a settings file."""
        def new(config: TacoConfig | None) -> TacoConfig | None:
            return None if config is None else change(config)
        return replace(self, forward=new(self.forward), backward=new(self.backward),
                       sites={pattern: new(config) for pattern, config in self.sites.items()})

    def replace(self, **changes) -> "Compression":
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def fit(self, hidden_size: int) -> "Compression":
        """This compression for a model of hidden size ``hidden_size``: below 128, every group
        size above it becomes the largest power of two <= it (at least 32), so that a group
        does not straddle rows. The command lines apply it unless ``--group-size`` is given;
        every other entry takes a `Compression` as it is."""
        if hidden_size >= 128:
            return self
        fit = max(32, 1 << (max(1, int(hidden_size)).bit_length() - 1))
        return self.map_configs(lambda c: c.replace(group_size=fit) if c.group_size > fit else c)

    def config_for(self, site: str) -> TacoConfig | None:
        """The codec settings of the site called ``site`` (None: plain)."""
        return self.rule_for(site)[0]

    # -- JSON ---------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """JSON-ready values; ``from_dict`` gives back an equal `Compression`."""
        conf = lambda c: None if c is None else c.to_dict()  # noqa: E731
        return {"mode": self.mode, "forward": conf(self.forward), "backward": conf(self.backward),
                "sites": {p: conf(c) for p, c in self.sites.items()}, "threshold_bytes": self.threshold_bytes,
                "piece_bytes": self.piece_bytes}

    @classmethod
    def from_dict(cls, values: Mapping, *, where: str = "compression") -> "Compression":
        """A `Compression` from ``{"mode": ..., "forward": ..., "backward": ..., "sites": {...}}``
        (each config a `TacoConfig`, a dict of its fields, or None; a missing key takes its
        default; ``"threshold_bytes"`` and ``"piece_bytes"`` too), or from a dict of `TacoConfig`
        fields alone (mode ``"on"`` with them both ways; the two policy keys may join them).
        Errors name ``where`` and the bad key."""
        if not isinstance(values, Mapping):
            raise ConfigTypeError(f"{where}: Compression.from_dict takes a dict, got {type(values).__name__} "
                                  f"{values!r}")
        keys = set(values)
        if "auto" in keys:
            raise ConfigError(f"{where}: the key 'auto' was removed; write \"mode\": \"auto\" or \"on\"")
        policy = {k: values[k] for k in POLICY if k in values}
        if keys & CONFIG_FIELDS and keys <= CONFIG_FIELDS | set(POLICY):
            config = _config(where, {k: v for k, v in values.items() if k in CONFIG_FIELDS})
            return cls._build(where, dict(mode="on", forward=config, backward=config, **policy))
        unknown = keys - set(KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; {DICT_HELP}")
        kwargs = {"mode": values["mode"], **policy} if "mode" in values else policy
        for key in ("forward", "backward"):
            if key in values:
                kwargs[key] = _config(f"{where}[{key!r}]", values[key])
        if "sites" in values:
            sites = values["sites"]
            if not isinstance(sites, Mapping):
                raise ConfigTypeError(f"{where}['sites']={sites!r} must be a dict {{pattern: TacoConfig fields "
                                      "or null}}")
            kwargs["sites"] = {p: _config(f"{where}['sites'][{p!r}]", v) for p, v in sites.items()}
        return cls._build(where, kwargs)

    @classmethod
    def _build(cls, where: str, kwargs: dict) -> "Compression":
        try:
            return cls(**kwargs)
        except ConfigError as e:  # ConfigTypeError is no ConfigError: both named
            raise ConfigError(f"{where}: {e}") from None
        except ConfigTypeError as e:
            raise ConfigTypeError(f"{where}: {e}") from None

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "Compression":
        """`from_dict` of the JSON object in the file ``path`` (e.g. ``json.dump(c.to_dict(), f)``)."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ConfigError(f"compression file {path!r} does not exist or is not a regular file; pass the path of "
                              "a JSON file (Compression.to_dict() written with json.dump), or 'auto', 'on', 'off'")
        try:
            with open(path, encoding="utf-8") as f:
                values = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise ConfigError(f"compression file {path}: not JSON ({e}); write an object such as "
                              '{"mode": "on", "forward": {"group_size": 64}, "backward": null}') from None
        if not isinstance(values, dict):
            raise ConfigError(f"compression file {path}: expected a JSON object, got a {type(values).__name__}; "
                              f"{DICT_HELP}")
        return cls.from_dict(values, where=f"compression file {path}")

    def __str__(self) -> str:
        if self.mode == "off":
            return "off"
        directions = ", ".join(f"{d} {'plain' if c is None else f'{c.format} G={c.group_size}'}"
                               for d, c in (("fwd", self.forward), ("bwd", self.backward)))
        overrides = f", {len(self.sites)} site patterns" if self.sites else ""
        floor = f", from {self.threshold_bytes} bytes" if self.threshold_bytes else ""
        return f"{self.mode} ({directions}{overrides}{floor})"


def check_same(given: Compression, existing: Compression, where: str) -> None:
    """A model already parallelised keeps its compression ``existing``: ``given`` (resolved) may
    be the default (``defaulted``: nothing was given) or equal to it; anything else raises a
    `ConfigError` naming both and the fix (the same on every rank, which all make this call)."""
    if given.defaulted or given == existing:
        return
    raise ConfigError(f"{where}: compression={given} was given for a model already parallelised with "
                      f"compression={existing}; a model keeps the compression it was parallelised with: pass the "
                      "same value (or none), or parallelise a fresh model with the compression you want")


# Every form `Compression.resolve` accepts: the type of a public entry's ``compression`` argument.
CompressionLike = Union[Compression, str, os.PathLike, TacoConfig, Mapping, None]


def _check_config(where: str, value: object) -> None:
    if value is None or isinstance(value, TacoConfig):
        return
    raise ConfigTypeError(f"{where}={value!r} must be a TacoConfig or None")


def _config(where: str, value: object) -> TacoConfig | None:
    """A site's settings from a `TacoConfig`, a dict of its fields, or None."""
    if value is None or isinstance(value, TacoConfig):
        return value
    if isinstance(value, Mapping):
        try:
            return TacoConfig.from_dict(dict(value))
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
        except TypeError as e:
            raise ConfigTypeError(f"{where}: {e}") from None
    raise ConfigTypeError(f"{where}={value!r} must be a TacoConfig, a dict of its fields, or None")
