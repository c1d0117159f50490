"""Ranks that disagree about a collective, caught before any byte moves; collectives that time out,
named.

Every rank of a group must make the same call: the same kind, element count, dtype and codec
settings, and so the same plain-or-compressed choice. When they do not, the transfer itself
rarely says so: tensors that pad to the same number of groups sum as garbage, two configs
decode each other's bytes, a plain all-reduce on one rank meets an all-to-all on the other and
waits forever. `check` exchanges a fingerprint of the call (8 integers, one all-gather over the
group) and raises a `CollectiveMismatch` on every rank that names the site, what differs and
each rank's value.

When: on each site's first calls (`CHECKED_CALLS`; sites are called in the same order on every
rank, so every rank checks the same calls) and, with ``TACO_CHECK_COLLECTIVES=1``, on every
call. A shape that changes only later on one rank is caught in that debug mode. Measured on 2
gloo ranks (2-core CPU, ``python -m taco_accel.bench.collectives --host``): one check costs
0.5-0.8 ms, the all-gather's round trip, so a model's first step pays it once per site (18
sites for a 2-layer model: 9-14 ms) and the debug mode once per call; under CUDA graph capture
it is skipped.

`named_timeouts` turns torch.distributed's timeout of a stalled peer into a `CollectiveTimeout`
naming the site, the collective and the group's ranks.
"""

from __future__ import annotations

import contextlib
import hashlib
import os

import torch
import torch.distributed as dist

from ..codec import TacoConfig
from ..errors import CollectiveMismatch, CollectiveTimeout

DEBUG_ENV = "TACO_CHECK_COLLECTIVES"
CHECKED_CALLS = 1  # per site
KINDS = ("all_reduce", "reduce_scatter", "all_gather")
FIELDS = ("collective", "elements", "rows", "dims", "dtype", "compressed", "codec settings", "codec settings")
_calls: dict[str, int] = {}


def debug() -> bool:
    return os.environ.get(DEBUG_ENV, "0") not in ("", "0", "false", "False")


def due(site: str) -> bool:
    """Whether this call of ``site`` is checked (counts the call)."""
    count = _calls.get(site, 0)
    _calls[site] = count + 1
    return count < CHECKED_CALLS or debug()


def fingerprint(kind: str, x: torch.Tensor, config: TacoConfig | None, compressed: bool) -> list[int]:
    """The call as 8 integers: kind, numel, dim 0, ndim, dtype, compressed, two words of a hash
    of the codec settings (format, group size, signs and their seed, scale layout, threshold...)."""
    settings = "plain" if config is None else repr(sorted(config.to_dict().items()))
    digest = hashlib.blake2b(settings.encode(), digest_size=8).digest()
    return [KINDS.index(kind), x.numel(), x.shape[0] if x.dim() else 1, x.dim(), _dtype_code(x.dtype),
            int(compressed), int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")]


def check(kind: str, x: torch.Tensor, group, config: TacoConfig | None, compressed: bool, site: str,
          world: int) -> None:
    """Raise `CollectiveMismatch` on every rank of ``group`` if their calls differ (a collective)."""
    if world == 1 or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    mine = torch.tensor(fingerprint(kind, x, config, compressed), dtype=torch.int64, device=x.device)
    every = [torch.empty_like(mine) for _ in range(world)]
    with named_timeouts(site, f"the agreement check of {kind}", group):
        dist.all_gather(every, mine, group=group)
    rows = [t.tolist() for t in every]
    differ = sorted({FIELDS[i] for i in range(len(FIELDS)) if len({row[i] for row in rows}) > 1})
    if not differ:
        return
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    shown = {
        "collective": [KINDS[row[0]] for row in rows], "elements": [row[1] for row in rows],
        "rows": [row[2] for row in rows], "dims": [row[3] for row in rows],
        "dtype": [str(_DTYPES[row[4]]) if row[4] < len(_DTYPES) else "other" for row in rows],
        "compressed": [bool(row[5]) for row in rows],
    }
    if "codec settings" in differ:  # every rank is here: one more exchange names the fields
        configs = [None] * world
        dist.all_gather_object(configs, None if config is None else config.to_dict(), group=group)
        keys = sorted({k for c in configs if c for k in c if len({None if d is None else d.get(k) for d in configs}) > 1})
        shown["codec settings"] = [None if c is None else {k: c[k] for k in keys} for c in configs]
    details = "; ".join(f"{name} by rank {dict(zip(ranks, shown[name]))}" for name in differ)
    raise CollectiveMismatch(
        f"{site}: the ranks {ranks} called {kind} differently ({details}). Every rank of a group must make "
        "the same call: the same tensor shape and dtype, the same TacoConfig (and so the same plain-or-"
        "compressed choice); check that every rank runs the same model, batch shape and settings"
    )


@contextlib.contextmanager
def named_timeouts(site: str, what: str, group):
    """Turn a timed-out transfer of ``what`` into a `CollectiveTimeout` naming ``site``."""
    try:
        yield
    except RuntimeError as error:
        text = str(error)
        if isinstance(error, CollectiveTimeout) or not any(k in text for k in ("imed out", "imeout")):
            raise
        ranks = dist.get_process_group_ranks(group) if group is not None else "all"
        raise CollectiveTimeout(
            f"{site}: {what} over ranks {ranks} got no answer within the group's timeout: a peer stopped, "
            f"died, or runs another collective (its own error names it). Raise the timeout with TACO_TIMEOUT_S "
            f"or --timeout if a step is legitimately that slow. ({text.splitlines()[0][:300]})"
        ) from error


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8,
           torch.int8, torch.bool]


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)
