"""Ranks that disagree about a collective, caught before any byte moves; collectives that time out,
named.

Every rank of a group must make the same call: the same kind, element count, dtype and codec
settings, and so the same plain-or-compressed choice and pieces. When they do not, the transfer
itself rarely says so: tensors that pad to the same number of groups sum as garbage, two configs
decode each other's bytes, a plain all-reduce on one rank meets an all-to-all on the other and
waits forever. `check` exchanges a fingerprint of the call (11 integers, one all-gather over the
group) and raises a `CollectiveMismatch` on every rank that names the site, what differs and
each rank's value.

When: on each site's first calls (`CHECKED_CALLS`, counted in the site's `stats.SiteRecord`;
sites are called in the same order on every rank, so every rank checks the same calls) and,
with ``TACO_CHECK_COLLECTIVES=1``, on every call. A message whose length changes only later on
one rank: compressed, with wire buffers of one size (lengths that round to as many groups),
every chunk's header carries a tag of the message's length and every received chunk is compared
on its device (`codec.api.compare_headers`: on the CPU it raises at once; on a GPU the chunk
reads as NaN and every rank raises at its next host sync); with buffers of different sizes, or
plain, the data collective itself is mismatched before any header is read: gloo raises or
aborts the process, NCCL may hang until the group's timeout or truncate, so only this debug mode
(and the models' input-shape check, `models.checks.InputIdsCheck`, once per new batch shape)
catches it there (ARCHITECTURE, "What is checked when"). The variable is read once per process (`debug`), and the setting is
part of the fingerprint: ranks that disagree about it fail at their first check, on every rank,
instead of one rank waiting in a check the others never make. One check costs one all-gather's
round trip (`python -m taco_accel.bench.collectives --host` prints it; benchmarks/RESULTS.md has
the figure); under CUDA graph capture it is skipped.

`named_timeouts` turns torch.distributed's timeout of a stalled peer into a `CollectiveTimeout`
naming the site, the collective and the group's ranks; or, where the layer above noted what each
rank fed the group in the forward under way (`note_input`: the models' input check notes the
ids' shape at every forward, a dictionary write) and the ranks' notes differ, into the error that
names the difference, on every rank: the ranks compare their notes through the group's store
(`upstream.torch.group_store`), which answers when the group itself no longer can. The case: a
rank whose batch shape is new checks it with its peers (`models.checks.InputIdsCheck`), while a
peer whose shape was agreed before goes straight to the model's collectives; each waits for the
other until the group's timeout.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from collections.abc import Callable
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..codec import CodecConfig
from ..errors import CollectiveMismatch, CollectiveTimeout, EnvironmentSettingError
from ..upstream.torch import group_store
from . import dist_ops

DEBUG_ENV = "TACO_CHECK_COLLECTIVES"
CHECKED_CALLS = 1  # per site
NAME_WORDS = 3  # a kind's name travels as 3 int64 words (24 ASCII bytes)
FIELDS = (*["collective"] * NAME_WORDS, "elements", "rows", "dims", "dtype", "compressed", "codec settings",
          "codec settings", DEBUG_ENV)
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


@functools.lru_cache(maxsize=None)
def debug() -> bool:
    """Whether ``TACO_CHECK_COLLECTIVES`` asks to check every call (read once per process)."""
    text = os.environ.get(DEBUG_ENV, "")
    if text.strip().lower() in _TRUE:
        return True
    if text.strip().lower() in _FALSE:
        return False
    raise EnvironmentSettingError(
        f"{DEBUG_ENV}={text!r} is not a switch; set it to 1 (check every collective call) or 0 / unset it"
    )


def due(record) -> bool:
    """Whether this call of the site whose `stats.SiteRecord` is ``record`` is checked (counts it)."""
    count = record.checked
    record.checked = count + 1
    return count < CHECKED_CALLS or debug()


def settings_hash(codec: CodecConfig | None, piece_bytes: int, mode: str | None = None) -> tuple[int, int]:
    """Two 32-bit words of a hash of the codec settings, the piece size and the site's mode, if
    given ("plain": no codec)."""
    settings = "plain" if codec is None else repr((sorted(codec.to_dict().items()), piece_bytes, mode))
    digest = hashlib.blake2b(settings.encode(), digest_size=8).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


def fingerprint(kind: str, shape, dtype: torch.dtype, codec: CodecConfig | None, compressed: bool,
                piece_bytes: int = 0, mode: str | None = None) -> list[int]:
    """The call as 11 integers: the kind's name (`NAME_WORDS` words), numel, dim 0, ndim, dtype,
    compressed, two words of a hash of the codec settings, piece size and mode, and this rank's
    ``TACO_CHECK_COLLECTIVES`` setting."""
    return [*_name_words(kind), shape.numel(), shape[0] if len(shape) else 1, len(shape), _dtype_code(dtype),
            int(compressed), *settings_hash(codec, piece_bytes, mode), int(debug())]


def check(kind: str, shape, dtype: torch.dtype, device, link, codec: CodecConfig | None, compressed: bool,
          site: str, piece_bytes: int = 0, mode: str | None = None) -> None:
    """Raise `CollectiveMismatch` on every rank of ``link``'s group if their calls differ (a
    collective); ``shape``, ``dtype``, ``device``: this rank's input.

    ``mode``: the site's mode (``Site.mode``), compared with the settings where the call itself
    does not show it (a point-to-point link checked before its first message)."""
    world, group = link.world, link.group
    device = torch.device(device)
    if world == 1 or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return
    mine = torch.tensor(fingerprint(kind, shape, dtype, codec, compressed, piece_bytes, mode), dtype=torch.int64,
                        device=device)
    every = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
    with named_timeouts(site, f"the agreement check of {kind}", group):
        link.all_gather(every, mine).wait()
    rows = every.view(world, -1).tolist()
    differ = [name for i, name in enumerate(FIELDS) if len({row[i] for row in rows}) > 1]
    differ = sorted(set(differ), key=differ.index)
    if not differ:
        return
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    named = [_name(row[:NAME_WORDS]) for row in rows]
    rows = [row[NAME_WORDS:] for row in rows]
    shown = {
        "collective": named, "elements": [row[0] for row in rows], "rows": [row[1] for row in rows],
        "dims": [row[2] for row in rows],
        "dtype": [str(_DTYPES[row[3]]) if row[3] < len(_DTYPES) else "other" for row in rows],
        "compressed": [bool(row[4]) for row in rows], DEBUG_ENV: [row[7] for row in rows],
    }
    if "codec settings" in differ:  # every rank is here: one more exchange names the fields
        mine_settings = None if codec is None else {**codec.to_dict(), "piece_bytes": piece_bytes}
        if mine_settings is not None and mode is not None:
            mine_settings["mode"] = mode
        configs = [None] * world
        dist.all_gather_object(configs, mine_settings, group=group)
        keys = sorted({k for c in configs if c for k in c if len({None if d is None else d.get(k) for d in configs}) > 1})
        shown["codec settings"] = [None if c is None else {k: c[k] for k in keys} for c in configs]
    details = "; ".join(f"{name} by rank {dict(zip(ranks, shown[name]))}" for name in differ)
    if differ == [DEBUG_ENV]:
        raise CollectiveMismatch(
            f"{site}: the ranks {ranks} disagree about {DEBUG_ENV} ({details}), so some would check every "
            f"collective call and the others would not; set {DEBUG_ENV} to the same value on every rank"
        )
    raise CollectiveMismatch(
        f"{site}: the ranks {ranks} called {kind} differently ({details}). Every rank of a group must make "
        "the same call: the same tensor shape and dtype, the same TacoConfig (and so the same plain-or-"
        "compressed choice); check that every rank runs the same model, batch shape and settings"
    )


def check_setting(name: str, value: dict, group=None, *, fix: str = "") -> None:
    """Raise `CollectiveMismatch` on every rank of ``group`` unless every rank passes the same
    ``value`` (a JSON-ready dict, e.g. ``Compression.to_dict()``) for the setting ``name``; the
    error names the entries that differ and each rank's values. A collective: one all-gather of
    a hash, and one of the values only when they differ. ``fix``: what the error tells to do."""
    link = dist_ops.link(group)
    if link.world == 1:
        return
    flat = _flatten(value)
    digest = hashlib.blake2b(json.dumps(flat, sort_keys=True, default=str).encode(), digest_size=8).digest()
    mine = torch.tensor([int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")],
                        dtype=torch.int64, device=_device_of(link))
    every = torch.empty(link.world * 2, dtype=torch.int64, device=mine.device)
    with named_timeouts(name, "the agreement check of a setting", group):
        link.all_gather(every, mine).wait()
    if len({tuple(row) for row in every.view(link.world, 2).tolist()}) == 1:
        return
    values = [None] * link.world
    dist.all_gather_object(values, flat, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(link.world))
    keys = sorted({k for v in values for k in v if len({repr(w.get(k)) for w in values}) > 1})
    details = "; ".join(f"{k} by rank {dict(zip(ranks, (v.get(k) for v in values)))}" for k in keys)
    raise CollectiveMismatch(f"{name}: the ranks {ranks} disagree ({details}); every rank must use the same "
                             f"setting{': ' + fix if fix else ''}")


def _flatten(value: dict, prefix: str = "") -> dict:
    out = {}
    for key, v in value.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = v
    return out


def _device_of(link) -> torch.device:
    """Where a small tensor of ``link``'s group lives (NCCL: this rank's GPU)."""
    if link.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def named_timeouts(site: str, what: str, group):
    """Turn a timed-out transfer of ``what`` into a `CollectiveTimeout` naming ``site``."""
    try:
        yield
    except RuntimeError as error:
        named = timeout_error(error, site, what, group)
        if named is error:
            raise
        raise named from error


class InputNote(NamedTuple):
    """What this rank fed a group in the forward under way (`note_input`)."""

    forward: int  # the group's forwards noted on this rank: the same count on every rank of it
    value: tuple  # e.g. the ids' (batch, sequence)
    explain: Callable[[dict[int, tuple], str], str]  # (every rank's value, the timeout in words) -> the error


_notes: dict = {}  # group (None: the default one) -> its latest InputNote
NOTES_WAIT_S = 10.0  # how long a timed-out rank waits for its peers' notes (their timeouts fire about as its own)


def note_input(group, value: tuple, explain: Callable[[dict[int, tuple], str], str]) -> None:
    """Keep ``value``, what this rank feeds ``group`` in the forward that starts, for a timeout of
    the group to compare with its peers' (`timeout_error`); ``explain(values by rank, what timed
    out)``: the error's message where they differ. A dictionary write per forward, nothing else."""
    last = _notes.get(group)
    _notes[group] = InputNote(0 if last is None else last.forward + 1, value, explain)


def timeout_error(error: RuntimeError, site: str, what: str, group) -> Exception:
    """For a torch.distributed timeout (or a peer's closed connection), the `CollectiveTimeout` naming ``site``, ``what`` timed out
    and the group's ranks (to raise ``from error``), or the `CollectiveMismatch` that names what
    the ranks fed the group differently (`note_input`); ``error`` itself for any other error."""
    text = str(error)
    timed_out = any(k in text for k in ("imed out", "imeout"))
    # gloo closes a pair whose op timed out on one side: the other side's op then fails with the
    # peer's closed connection, before its own timeout, for the same cause
    peer_gone = any(k in text for k in ("Connection closed by peer", "Connection reset by peer"))
    if isinstance(error, CollectiveTimeout) or not (timed_out or peer_gone):
        return error
    differing = _differing_notes(group)
    if differing is not None:
        values, explain = differing
        return CollectiveMismatch(explain(values, f"{site}: {what} {'timed out' if timed_out else 'lost its peer'}"))
    if not timed_out:
        return error
    ranks = dist.get_process_group_ranks(group) if group is not None else "all"
    return CollectiveTimeout(
        f"{site}: {what} over ranks {ranks} got no answer within the group's timeout: a peer stopped, "
        f"died, or runs another collective (its own error names it). Raise the timeout with TACO_TIMEOUT_S "
        f"or --timeout if a step is legitimately that slow. ({text.splitlines()[0][:300]})"
    )


def _differing_notes(group) -> tuple[dict[int, tuple], Callable] | None:
    """Every rank's note of the forward under way and its explanation, where the ranks of
    ``group`` noted different values; None where they agree, this rank noted none, or a peer's note
    did not come within `NOTES_WAIT_S` (a peer that died, or waits elsewhere). Through the group's
    store: one write and one wait per rank, only on this error path."""
    note = _notes.get(group)
    store = group_store(group) if note is not None else None
    if store is None:
        return None
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    key = f"taco/input_notes/{note.forward}/"
    try:
        store.set(key + str(dist.get_rank()), json.dumps(list(note.value)))
        store.wait([key + str(r) for r in ranks], timedelta(seconds=NOTES_WAIT_S))
        values = {r: tuple(json.loads(store.get(key + str(r)))) for r in ranks}
    except (RuntimeError, ValueError):  # a peer's note never came (the store's own timeout)
        return None
    return (values, note.explain) if len(set(values.values())) > 1 else None


def _name_words(kind: str) -> list[int]:
    """A kind's name as `NAME_WORDS` int64 words (its ASCII bytes, zero-padded)."""
    raw = kind.encode("ascii")[: 8 * NAME_WORDS].ljust(8 * NAME_WORDS, b"\0")
    return [int.from_bytes(raw[8 * i: 8 * i + 8], "little", signed=True) for i in range(NAME_WORDS)]


def _name(words: list[int]) -> str:
    return b"".join(w.to_bytes(8, "little", signed=True) for w in words).rstrip(b"\0").decode("ascii", "replace")


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8,
           torch.int8, torch.bool]


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)
