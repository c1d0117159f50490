"""Compressed collectives (layer 2) on gloo ranks.

Process spawns are the cost here, so each world size runs ONE launch (`_battery`) that goes
through every case and returns plain records; the tests below only read those records.
"""

from __future__ import annotations

import functools
import hashlib

import pytest
import torch
import torch.distributed as dist

from harness import case, per_case, run_ranks
from taco_accel import comm
from taco_accel.codec import NonFiniteError, TacoConfig, WireFormatError, WireLayout
from taco_accel.comm import EmulatedGroup, dist_ops
from taco_accel.comm.pieces import Pipeline, piece_bounds, piece_length
from torch.overrides import TorchFunctionMode

CFG = TacoConfig()  # compress even tiny messages
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SHAPES = ((1,), (5, 77), (3, 256), (2, 3, 129))  # numel 1, 385, 768, 774: most not multiples of P or G
# Relative RMS error vs the exact float64 result. One e4m3 round trip keeps 3 mantissa bits,
# about 0.026 on these inputs (outliers included); all_reduce / reduce_scatter quantise twice
# (each rank's input, then the sum), about sqrt(2) times that.
# Relative L2 error of the collectives on these seeded Gaussian-like inputs. Rounding to nearest
# moves a value uniformly within half a step; E4M3's step is 2**-3 of the value's binade, so over
# values spread through their binades the rms relative error is about 2**-3 / sqrt(12) * 0.72 =
# 2.6% per encoding (the worst case per group is 2**-4 = 6.25%). One encoding for the all-gather
# (bound 4%), two for the all-reduce and reduce-scatter (each rank's chunk, then the sum: about
# sqrt(2) x, bound 5.5%); E5M2 has one mantissa bit less (2x), INT8 per group about 4x less than E4M3.
# The inputs are seeded, so the figures are fixed on a machine; an fp32 rounding elsewhere can
# only flip single values, far below the margin.
BOUND = {"all_gather": 0.04, "all_reduce": 0.055, "reduce_scatter": 0.055}
FORMAT_BOUND = {"e4m3": 0.055, "e5m2": 0.11, "int8": 0.02}
# torch 2.13 deprecates the *_tensor names; older versions only have them
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# --- helpers run inside the ranks ---------------------------------------------------------------


def _input(case: int, rank: int, shape, dtype=torch.float32) -> torch.Tensor:
    """The deterministic input of ``rank`` for ``case`` (every rank can rebuild every input)."""
    gen = torch.Generator().manual_seed(1000 * case + rank)
    x = torch.randn(shape, generator=gen)
    spikes = torch.rand(shape, generator=gen) < 0.01  # a few outliers, as in activations
    return torch.where(spikes, x * 30, x).to(dtype)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _rel(result: torch.Tensor, exact: torch.Tensor) -> float:
    return float((result.double() - exact).norm() / exact.norm())


def _run_op(op: str, case: int, shape, dtype, group, members: list[int], config=CFG):
    """Run one collective; return (result, exact float64 result) for this rank."""
    me = members.index(dist.get_rank())
    xs = [_input(case, r, shape, dtype) for r in members]
    if op == "all_gather":
        exact = torch.cat([x.double() for x in xs])
    else:
        exact = sum(x.double() for x in xs)
    if op == "reduce_scatter":
        m = exact.shape[0] // len(members)
        exact = exact[me * m : (me + 1) * m]
    return getattr(comm, op)(xs[me], group, config), exact


def _accuracy(group, members: list[int]) -> list[dict]:
    """Every op x dtype x shape: error vs exact and a digest of the result."""
    records = []
    world = len(members)
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        for dtype in DTYPES:
            for i, shape in enumerate(SHAPES):
                if op == "reduce_scatter":
                    shape = (world * shape[0], *shape[1:])
                out, exact = _run_op(op, 10 + i, shape, dtype, group, members)
                assert out.dtype == dtype and out.shape == exact.shape, (op, out.dtype, out.shape)
                records.append(
                    dict(op=op, dtype=str(dtype), shape=shape, case=10 + i, err=_rel(out, exact), digest=_digest(out))
                )
    return records


def _formats() -> list[dict]:
    """all_reduce under the other formats and scale layouts."""
    members = list(range(dist.get_world_size()))
    records = []
    for fmt in ("e4m3", "e5m2", "int8"):
        for extra in ({}, {"scales": "dual"}, {"random_signs": True}, {"group_size": 32}):
            cfg = CFG.replace(format=fmt, **extra)
            out, exact = _run_op("all_reduce", 30, (4, 160), torch.float32, None, members, cfg)
            records.append(dict(fmt=fmt, extra=extra, err=_rel(out, exact), digest=_digest(out)))
    return records


def _plain() -> dict:
    """config=None and compress=False must equal torch.distributed bit for bit."""
    world, rank = dist.get_world_size(), dist.get_rank()
    same = {}
    for dtype in DTYPES:
        x = _input(40, rank, (world * 3, 5), dtype)
        ref_ar = x.clone()
        dist.all_reduce(ref_ar)
        ref_rs = torch.empty(3, 5, dtype=dtype)
        _REDUCE_SCATTER(ref_rs, x)
        ref_ag = torch.empty(world * world * 3, 5, dtype=dtype)
        _ALL_GATHER(ref_ag, x)
        for name, cfg, compress in (("none", None, None), ("compress=False", TacoConfig(), False)):
            same[(str(dtype), name)] = (
                torch.equal(comm.all_reduce(x, None, cfg, compress=compress), ref_ar)
                and torch.equal(comm.reduce_scatter(x, None, cfg, compress=compress), ref_rs)
                and torch.equal(comm.all_gather(x, None, cfg, compress=compress), ref_ag)
            )
    return same


def _threshold() -> dict:
    """A site's message of its Compression's threshold_bytes or more is compressed, a smaller one is not."""
    x = _input(50, dist.get_rank(), (1000,))  # 4000 bytes
    comm.pop_comm_stats()
    seen = {}
    for threshold in (3999, 4000, 4001):
        policy = comm.Compression("on", CFG, CFG, threshold_bytes=threshold)
        comm.Site("t", None, policy.config_for("t"), threshold_bytes=policy.threshold_bytes).run("all_reduce", x)
        seen[threshold] = comm.pop_comm_stats()["t"].compressed_calls
    return seen


def _count_pieces(op: str, x: torch.Tensor, cfg: TacoConfig, piece_bytes: int):
    """Run ``op`` and count the collectives its pieces issued (first exchange of each piece)."""
    name = "all_gather" if op == "all_gather" else "all_to_all"
    original = getattr(dist_ops.Link, name)
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    setattr(dist_ops.Link, name, counting)
    try:
        out = getattr(comm, op)(x, None, cfg, piece_bytes=piece_bytes)
    finally:
        setattr(dist_ops.Link, name, original)
    return out, len(calls)


def _pieces() -> list[dict]:
    """piece_bytes > 0 splits the message; the result must equal the single-piece path bit for bit."""
    world, rank = dist.get_world_size(), dist.get_rank()
    members = list(range(world))
    records = []
    for dtype in (torch.float32, torch.bfloat16):
        for op, shape in (("all_reduce", (7, 433)), ("reduce_scatter", (world * 3, 301)), ("all_gather", (5, 301))):
            x = _input(60, rank, shape, dtype)
            whole, n_whole = _count_pieces(op, x, CFG, 0)
            _, exact = _run_op(op, 60, shape, dtype, None, members)
            for piece_bytes in (512, 1024, 2000):
                split, n_split = _count_pieces(op, x, CFG, piece_bytes)
                records.append(dict(
                    op=op, dtype=str(dtype), piece_bytes=piece_bytes, pieces=(n_whole, n_split),
                    err=_rel(split, exact), same=torch.equal(split, whole), digest=_digest(split),
                ))
    return records


def _drift(steps: int = 40) -> list[str]:
    """A loop that feeds each result back (rank-dependent): replicas must stay bit-identical."""
    rank, world = dist.get_rank(), dist.get_world_size()
    y = _input(70, 0, (6, 200))
    digests = []
    for step in range(steps):
        noise = _input(71 + step, rank, (6, 200)) * 0.1
        y = comm.all_reduce(torch.tanh(y) * (rank + 1) + noise, None, CFG) / world
        digests.append(_digest(y))
    return digests


def _nonfinite() -> dict:
    """NaN / Inf on rank 1 only, under every policy and on both paths."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for bad in (float("nan"), float("inf")):
        for op in ("all_reduce", "reduce_scatter", "all_gather"):
            x = _input(80, rank, (world * 2, 256))
            if rank == 1:
                x[1, 5] = bad  # group 2 of rank 1's input (row 0 of block 0 for reduce_scatter)
            for policy in ("propagate", "zero", "raise"):
                for label, compress in (("compressed", True), ("plain", False)):
                    cfg = CFG.replace(nonfinite=policy)
                    try:
                        y = getattr(comm, op)(x, None, cfg, compress=compress)
                        got = ("ok", torch.isfinite(y).logical_not().nonzero().tolist())
                    except NonFiniteError:
                        got = ("raised", None)
                    out[(str(bad), op, policy, label)] = got
    # the group still works after the raises (no rank left behind in a collective)
    out["after"] = _digest(comm.all_reduce(torch.ones(300), None, CFG))
    return out


def _stats() -> dict:
    """Byte figures of known calls, error sampling, reset."""
    rank = dist.get_rank()
    comm.pop_comm_stats()
    x = _input(90, rank, (1000,))  # fp32, 4000 bytes
    comm.all_reduce(x, None, CFG, site="ar")
    comm.all_reduce(x.half(), None, None, site="ar")  # plain: 2000 bytes
    comm.reduce_scatter(_input(91, rank, (dist.get_world_size() * 3, 100)), None, CFG, site="rs")
    comm.all_gather(x.bfloat16(), None, CFG)  # default site name
    figures = {site: s.to_dict() for site, s in comm.pop_comm_stats().items()}
    comm.set_error_sampling(2)
    for _ in range(5):
        comm.all_reduce(x, None, CFG, site="sampled")
        comm.all_reduce(x, None, None, site="sampled")  # plain calls are not sampled
    sampled = comm.pop_comm_stats()["sampled"]
    comm.set_error_sampling(1)
    comm.reduce_scatter(_input(92, rank, (dist.get_world_size() * 2, 200)), None, CFG, site="rs_err")
    comm.all_gather(x, None, CFG, site="ag_err")
    other = {site: s.to_dict() for site, s in comm.pop_comm_stats().items()}
    comm.set_error_sampling(0)
    comm.all_reduce(x, None, CFG, site="off")
    off = comm.pop_comm_stats()["off"].error_samples
    return dict(figures=figures, sampled=sampled.to_dict(), other=other, off=off, empty=comm.pop_comm_stats())


def _misc() -> dict:
    """requires_grad inputs, bad input errors, the isend/irecv all-to-all."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    x = _input(95, rank, (world * 2, 128)).requires_grad_()
    results = [comm.all_reduce(x, None, CFG), comm.reduce_scatter(x, None, CFG), comm.all_gather(x, None, CFG),
               comm.all_reduce(x, None, None)]
    out["grad"] = [r.requires_grad for r in results]
    strided = _input(97, rank, (256, world * 4)).t()  # non-contiguous input
    out["strided"] = all(
        torch.equal(fn(strided, None, CFG), fn(strided.contiguous(), None, CFG))
        for fn in (comm.all_reduce, comm.reduce_scatter, comm.all_gather)
    )
    for name, call in (("rs_rows", lambda: comm.reduce_scatter(torch.ones(world + 1, 4), None, CFG)),
                       ("ag_0d", lambda: comm.all_gather(torch.ones(()), None, CFG))):
        try:
            call()
            out[name] = "no error"
        except ValueError as err:
            out[name] = str(err)
    send = torch.arange(world * 5, dtype=torch.uint8) + 7 * rank
    native, p2p = torch.empty_like(send), torch.empty_like(send)
    dist.all_to_all_single(native, send)
    dist_ops.all_to_all_p2p(p2p, send).wait()
    out["p2p"] = torch.equal(native, p2p)
    x = _input(96, rank, (3, 300))
    expected = comm.all_reduce(x, None, CFG)
    dist_ops._no_native_all_to_all.add(str(dist.get_backend()))  # as if gloo had no all_to_all
    try:
        out["p2p_all_reduce"] = torch.equal(comm.all_reduce(x, None, CFG), expected)
    finally:
        dist_ops._no_native_all_to_all.clear()
    return out


def _subgroups() -> dict:
    """World of 4 as two groups of 2 (contiguous and strided), and groups of one."""
    rank = dist.get_rank()
    out = {}
    for kind, layout in (("contiguous", ([0, 1], [2, 3])), ("strided", ([0, 2], [1, 3]))):
        groups = [dist.new_group(ranks) for ranks in layout]  # every rank creates every group
        members = next(ranks for ranks in layout if rank in ranks)
        group = groups[layout.index(members)]
        out[kind] = dict(members=members, records=_accuracy(group, members))
        send = torch.arange(10, dtype=torch.uint8) + 10 * rank
        native, p2p = torch.empty_like(send), torch.empty_like(send)
        dist.all_to_all_single(native, send, group=group)
        dist_ops.all_to_all_p2p(p2p, send, group).wait()
        out[kind]["p2p"] = torch.equal(native, p2p)
    singles = [dist.new_group([r]) for r in range(4)]
    x = _input(99, rank, (4, 130))
    out["single"] = all(
        torch.equal(fn(x, singles[rank], CFG), x)
        for fn in (comm.all_reduce, comm.reduce_scatter, comm.all_gather)
    )
    return out


def _autotune() -> dict:
    """`autotune.time_collective`: real timings agree on every rank; the rule on fixed clocks."""
    from taco_accel.comm import autotune

    rank = dist.get_rank()
    x = _input(98, rank, (4, 256))
    out = {"real": [autotune.time_collective(op, x, None, CFG).to_dict() for op in ("all_reduce", "all_gather")]}
    clocks = {  # (plain, compressed) seconds per timed call, on rank 0 and on the others
        "faster": ((1.0, 0.9), (1.0, 0.9)),
        "within_margin": ((1.0, 0.96), (1.0, 0.96)),
        "one_rank_slow": ((1.0, 3.0), (1.0, 0.5)),
    }
    original = autotune._seconds
    try:
        for label, per_rank in clocks.items():
            ticks = iter(per_rank[rank > 0] * autotune.REPS)

            def fake(call, device, ticks=ticks):
                call()
                return next(ticks)

            autotune._seconds = fake
            out[label] = autotune.time_collective("all_reduce", x, None, CFG).to_dict()
    finally:
        autotune._seconds = original
    return out


def _chunked() -> list[dict]:
    """The per-rank kinds (gather_by_rank / scatter_by_rank) against all_gather / reduce_scatter
    of the same rank blocks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    records = []
    pieces = 1024
    for label, cfg in (("plain", None), ("compressed", CFG)):
        for dtype in (torch.float32, torch.bfloat16):
            x = _input(99, rank, (2, 3, 70), dtype)  # a (b, s/P, h) shard; 420 values: not whole groups
            gathered = comm.Site("g", None, cfg, piece_bytes=pieces).gather_by_rank(x)
            order = [r for r, _ in gathered.landed()]
            parts = gathered.wait()  # (P, *x.shape): part r at [r]
            one_shot = comm.all_gather(x.unsqueeze(0), None, cfg, piece_bytes=pieces)  # (P, 2, 3, 70)
            partials = [_input(100 + r, rank, (2, 3, 70), dtype) for r in range(world)]  # rank r's rows
            sums = comm.Site("s", None, cfg, piece_bytes=pieces).scatter_by_rank(x.shape, dtype, x.device)
            for r, part in enumerate(partials):
                sums.submit(r, part)
            mine = sums.wait()
            expect = comm.reduce_scatter(torch.stack(partials), None, cfg, piece_bytes=pieces).squeeze(0)
            figures = comm.pop_comm_stats()
            records.append(dict(
                label=label, dtype=str(dtype), order=order,
                gather_same=all(torch.equal(p, one_shot[r]) for r, p in enumerate(parts)),
                scatter_same=torch.equal(mine, expect),
                scatter_ulps=float((mine.float() - expect.float()).abs().max() / expect.float().abs().max())
                / torch.finfo(dtype).eps,
                compressed=(figures["g"].compressed_calls, figures["s"].compressed_calls),
                digest=_digest(parts), mine_digest=_digest(mine),
            ))
    return records


def _in_flight() -> dict:
    """Two compressed collectives in flight at once (async_op, several pieces each, advanced in
    turn): the second cannot use the busy workspace; both equal their synchronous results."""
    rank = dist.get_rank()
    cfg, p = CFG, 1024
    a, b = _input(110, rank, (7, 433)), _input(111, rank, (5, 301))
    expect_a, expect_b = comm.all_reduce(a, None, cfg, piece_bytes=p), comm.all_gather(b, None, cfg, piece_bytes=p)
    first = comm.all_reduce(a, None, cfg, async_op=True, piece_bytes=p)
    second = comm.all_gather(b, None, cfg, async_op=True, piece_bytes=p)
    for _ in range(3):
        first.progress()
        second.progress()
    return {"same": torch.equal(second.wait(), expect_b) and torch.equal(first.wait(), expect_a)}


class TorchCalls(TorchFunctionMode):
    """The names of the torch functions called inside it (``names``)."""

    def __init__(self) -> None:
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


HOST_READS = ("__bool__", "item", "tolist", "__float__", "__int__", "nonzero")  # what makes the host wait for a GPU


def _run_state() -> dict:
    """Run-time state per ledger (a model's site table), the debug switch agreed on by the ranks,
    and what a steady plain / compressed call does on the host."""
    import os

    from taco_accel.bench.collectives import own_costs
    from taco_accel.comm import agreement

    rank = dist.get_rank()
    out = {}
    first, second = comm.Ledger(), comm.Ledger()  # two models with a site of one name
    comm.Site("blk/fwd", None, None, ledger=first).run("all_reduce", torch.ones(8))
    try:  # the second model's first call is checked too: its ranks disagree here
        comm.Site("blk/fwd", None, None, ledger=second).run("all_reduce", torch.ones(8 + rank))
        out["second_table"] = "no error"
    except comm.CollectiveMismatch as error:
        out["second_table"] = str(error)
    out["counts"] = ({k: v.calls for k, v in first.pop().items()}, {k: v.calls for k, v in second.pop().items()})
    saved = os.environ.get(agreement.DEBUG_ENV)
    os.environ[agreement.DEBUG_ENV] = "1" if rank == 0 else "0"  # set on one rank only
    agreement.debug.cache_clear()
    try:
        comm.all_reduce(torch.ones(4), site="debug/first")
        out["debug"] = "no error"
    except comm.CollectiveMismatch as error:
        out["debug"] = str(error)
    finally:
        os.environ.pop(agreement.DEBUG_ENV) if saved is None else os.environ.update({agreement.DEBUG_ENV: saved})
        agreement.debug.cache_clear()
    out["after"] = _digest(comm.all_reduce(torch.ones(4), site="debug/after"))  # the group still works

    x = torch.ones(64)
    with TorchCalls() as ops:
        comm.all_reduce(x, None, TacoConfig(), compress=False, inplace=True)  # config given, plain
    out["plain_ops"] = ops.names
    out["own"] = own_costs(1024, 2, 1, torch.device("cpu"))  # transfers and codec kernels stubbed
    return out


def _checks() -> dict:
    """Integer and float64 tensors through compressing settings (exact: they go plain), forced
    compression of one (an error), and ranks whose later calls at a site differ in length."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    big = torch.arange(world * 3000, dtype=torch.int64) * 1_000_003 + rank  # far past fp8's 3 mantissa bits
    for dtype in (torch.int64, torch.int32, torch.float64):
        x = big.to(dtype)
        exact_ar = x.clone()
        dist.all_reduce(exact_ar)
        exact_ag = torch.empty(world * x.numel(), dtype=dtype)
        _ALL_GATHER(exact_ag, x)
        exact_rs = torch.empty(x.numel() // world, dtype=dtype)
        _REDUCE_SCATTER(exact_rs, x)
        site = comm.Site(f"int/{dtype}", None, CFG)  # "on": every message it may compress
        out[str(dtype)] = dict(
            same=torch.equal(comm.all_reduce(x, None, CFG), exact_ar)
            and torch.equal(comm.all_gather(x, None, CFG), exact_ag)
            and torch.equal(comm.reduce_scatter(x, None, CFG), exact_rs)
            and torch.equal(site.run("all_reduce", x), exact_ar),
            compressed=site.record.compressed_calls,
        )
    try:
        comm.all_reduce(big, None, CFG, compress=True)
        out["forced"] = "no error"
    except TypeError as error:
        out["forced"] = str(error)
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        site = comm.Site(f"later/{kind}", None, CFG)
        # 4000 against 4090 values (reduce_scatter: rows of 2000 against 2045 per rank): the same
        # wire size at P <= 4 (as many whole groups of 128), so the transfer itself cannot tell
        rows = (world,) if kind == "reduce_scatter" else ()
        cols = 2000 if kind == "reduce_scatter" else 4000
        site.run(kind, torch.ones(*rows, cols))  # the first call: the same on every rank (and checked)
        try:
            got = site.run(kind, torch.ones(*rows, cols if rank == 0 else cols + cols * 90 // 4000))
            out[kind] = f"no error: {list(got.shape)}"
        except ValueError as error:
            out[kind] = str(error)
    out["after"] = _digest(comm.all_reduce(torch.ones(300), None, CFG))  # the group still works
    return out


def _call(site, kind: str, cols: int, world: int, device: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One call of ``kind`` at ``site`` with ``cols`` values a rank (a row of ``cols`` per rank for
    the reductions): its result, and that result as parts (the gathers: one per rank)."""
    ones = functools.partial(torch.ones, device=device)
    if kind == "gather_by_rank":
        call = site.gather_by_rank(ones(cols))
        for _ in call.landed():  # as the SP overlap takes them
            pass
        out = call.wait()
        return out, list(out.view(world, cols))
    if kind == "scatter_by_rank":
        call = site.scatter_by_rank((cols,), torch.float32, device)
        for r in range(world):
            call.submit(r, ones(cols))
        out = call.wait()
        return out, [out]
    rows = (world,) if kind == "reduce_scatter" else ()
    out = site.run(kind, ones(*rows, cols))
    return out, list(out.view(world, cols)) if kind == "all_gather" else [out]


def _headers_on_device(device: str = "cpu") -> dict:
    """A GPU's header agreement (the flags compared on the device, read at the next host sync),
    on ``device``: on the CPU with `codec.api.READ_AT_ONCE` emptied (the same code on CPU
    tensors). Ranks whose later call at a site differs in length (wire buffers of one size: the
    transfer cannot tell), per kind and nonfinite policy; and the host reads of a matching call."""
    from taco_accel.codec import api

    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        torch.cuda.set_device(0)
    saved = api.read_at_once()
    api.READ_AT_ONCE = tuple(t for t in saved if t != device)
    out = {}
    try:
        kinds = ("all_reduce", "all_gather", "reduce_scatter", "gather_by_rank", "scatter_by_rank")
        for nonfinite, checked in (("propagate", kinds), ("raise", kinds[::2])):  # "raise": Call.wait, any kind
            for kind in checked:
                ledger = comm.Ledger()
                site = comm.Site(f"device/{kind}", None, CFG.replace(nonfinite=nonfinite), ledger=ledger)
                cols = 2000 if "scatter" in kind else 4000  # against 2045 / 4090: as many whole groups of 128
                _call(site, kind, cols, world, device)  # the first call: the same on every rank (and checked)
                with TorchCalls() as calls:
                    _call(site, kind, cols, world, device)  # a steady matching call
                got = dict(host_reads=[n for n in calls.names if n in HOST_READS], at_call=None, at_pop=None)
                try:
                    _, parts = _call(site, kind, cols if rank == 0 else cols + cols * 90 // 4000, world, device)
                    got["nan_parts"] = [bool(p.isnan().all()) for p in parts]
                    got["finite_parts"] = [bool(p.isfinite().all()) for p in parts]
                except WireFormatError as error:
                    got["at_call"] = str(error)
                try:
                    ledger.pop()
                except WireFormatError as error:
                    got["at_pop"] = str(error)
                _call(site, kind, cols, world, device)  # the group and the site still work
                got["pop_after"] = sorted(ledger.pop())
                out[f"{kind}/{nonfinite}"] = got
    finally:
        api.READ_AT_ONCE = saved
    return out


def _battery() -> dict:
    world = dist.get_world_size()
    cases = dict(
        accuracy=functools.partial(_accuracy, None, list(range(world))), formats=_formats, plain=_plain,
        threshold=_threshold, pieces=_pieces, drift=_drift, nonfinite=_nonfinite,
        stats=_stats, misc=_misc, autotune=_autotune, chunked=_chunked, in_flight=_in_flight,
        run_state=_run_state, checks=_checks,
    )
    if world == 4:
        cases["subgroups"] = _subgroups
    if world == 3:  # one rank of another length, two that agree
        cases["headers_on_device"] = _headers_on_device
    return per_case(cases)


# --- the tests (parent process) -----------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda p: f"P{p}")
def ranks(request) -> list[dict]:
    """The battery's records, one dict per rank, for world size P (one launch per P)."""
    return run_ranks(_battery, request.param)


def _view(ranks: list[dict], *keys: str) -> list[dict]:
    """``[{key: value}]`` per rank for the battery's cases ``keys``; a case that raised fails here."""
    values = {key: case(ranks, key) for key in keys}
    return [{key: values[key][rank] for key in keys} for rank in range(len(ranks))]


def _same_across(records_per_rank: list[list[dict]], ranks_: list[int]) -> None:
    for i, rec in enumerate(records_per_rank[ranks_[0]]):
        digests = {records_per_rank[r][i]["digest"] for r in ranks_}
        assert len(digests) == 1, f"ranks {ranks_} disagree on {rec}"


def test_accuracy_within_codec_bound(ranks):
    ranks = _view(ranks, "accuracy")
    for per_rank in ranks:
        for rec in per_rank["accuracy"]:
            assert rec["err"] < BOUND[rec["op"]], rec


def test_emulated_group_gives_the_real_collectives_bytes(ranks):
    """`EmulatedGroup` on one process, fed every rank's input, returns what each real rank got."""
    ranks = _view(ranks, "accuracy")
    world = len(ranks)
    group = EmulatedGroup(world)
    for rank, per_rank in enumerate(ranks):
        for rec in per_rank["accuracy"]:
            if rank > 0 and rec["op"] != "reduce_scatter":
                continue  # the same bytes on every rank (checked below)
            dtype = getattr(torch, rec["dtype"].removeprefix("torch."))
            xs = [_input(rec["case"], r, rec["shape"], dtype) for r in range(world)]
            out = getattr(group, rec["op"])(xs, CFG)
            out = out[rank] if rec["op"] == "reduce_scatter" else out
            assert _digest(out) == rec["digest"], rec


def test_all_reduce_and_all_gather_identical_on_every_rank(ranks):
    ranks = _view(ranks, "accuracy", "formats")
    world = list(range(len(ranks)))
    _same_across([[r for r in p["accuracy"] if r["op"] != "reduce_scatter"] for p in ranks], world)
    _same_across([p["formats"] for p in ranks], world)


def test_formats_and_scale_layouts(ranks):
    ranks = _view(ranks, "formats")
    for rec in ranks[0]["formats"]:
        assert rec["err"] < FORMAT_BOUND[rec["fmt"]], rec


def test_plain_path_equals_torch_distributed(ranks):
    ranks = _view(ranks, "plain")
    for per_rank in ranks:
        assert all(per_rank["plain"].values()), per_rank["plain"]


def test_threshold(ranks):
    ranks = _view(ranks, "threshold")
    assert ranks[0]["threshold"] == {3999: 1, 4000: 1, 4001: 0}


def test_pieces_match_single_piece_path(ranks):
    ranks = _view(ranks, "pieces")
    for per_rank in ranks:
        for rec in per_rank["pieces"]:
            n_whole, n_split = rec["pieces"]
            assert n_whole == 1 and n_split >= 2, rec
            assert rec["err"] < BOUND[rec["op"]], rec
            assert rec["same"], rec  # pieces cut at group boundaries: the same bytes, bit for bit
    records = [[r for r in p["pieces"] if r["op"] != "reduce_scatter"] for p in ranks]
    _same_across(records, list(range(len(ranks))))


def test_no_drift_between_replicas(ranks):
    ranks = _view(ranks, "drift")
    for per_rank in ranks[1:]:
        assert per_rank["drift"] == ranks[0]["drift"]


def test_nonfinite_policies(ranks):
    ranks = _view(ranks, "nonfinite")
    world = len(ranks)
    for per_rank in ranks:
        got = per_rank["nonfinite"]
        assert got["after"] == ranks[0]["nonfinite"]["after"]
        for bad in ("nan", "inf"):
            for path in ("compressed", "plain"):
                for op in ("all_reduce", "reduce_scatter", "all_gather"):
                    assert got[(bad, op, "raise", path)] == ("raised", None)
                    assert got[(bad, op, "zero", path)] == ("ok", [])
                _check_propagate(got, bad, path, per_rank is ranks[0], world)


def _check_propagate(got: dict, bad: str, path: str, rank0: bool, world: int) -> None:
    """Rank 1 has a bad value at [1, 5]: its G=128 group decodes to NaN (compressed)."""
    status, where = got[(bad, "all_reduce", "propagate", path)]
    assert status == "ok"
    expect = [[1, c] for c in range(128)] if path == "compressed" else [[1, 5]]
    assert where == expect
    status, where = got[(bad, "all_gather", "propagate", path)]
    assert where == [[2 * world + 1, c] for c in range(128)] if path == "compressed" else [[2 * world + 1, 5]]
    status, where = got[(bad, "reduce_scatter", "propagate", path)]
    if rank0:  # rank 0 holds rows [0, 2) of the sum, where rank 1's bad value lands
        assert where == expect
    else:
        assert where == []


def test_stats_figures(ranks):
    ranks = _view(ranks, "stats")
    world = len(ranks)
    figures = ranks[0]["stats"]["figures"]
    # all_reduce fp32 [1000] as P chunks: sends P-1 chunks twice (all-to-all, all-gather);
    # the plain half-precision call sends the ring's 2(P-1)/P * 2000 bytes, both figures
    chunk = WireLayout.for_tensor(1000, CFG, world).chunk_bytes
    assert figures["ar"]["calls"] == 2 and figures["ar"]["compressed_calls"] == 1
    plain = [2 * (world - 1) * nbytes // world for nbytes in (4000, 2000)]  # each call rounds down
    assert figures["ar"]["bytes_sent"] == 2 * (world - 1) * chunk + plain[1]
    assert figures["ar"]["bytes_uncompressed"] == sum(plain)
    # reduce_scatter fp32 [P*3, 100]: each rank's block of 300 values is one chunk of 3 groups
    assert figures["rs"]["bytes_sent"] == (world - 1) * WireLayout.for_tensor(300, CFG).chunk_bytes
    assert figures["rs"]["bytes_uncompressed"] == (world - 1) * 1200
    # all_gather bf16 [1000]: one buffer of 8 groups to each of P-1 peers
    assert figures["all_gather"]["bytes_sent"] == (world - 1) * WireLayout.for_tensor(1000, CFG).total_bytes
    assert figures["all_gather"]["bytes_uncompressed"] == (world - 1) * 2000
    if world == 2:  # 4 groups of 128 B payload + 4 B scale per chunk, then at most 16 B of header / padding
        assert 528 <= chunk <= 528 + 16 and chunk % 16 == 0, chunk
        assert figures["ar"]["bytes_uncompressed"] == 6000
    sampled = ranks[0]["stats"]["sampled"]
    assert sampled["calls"] == 10 and sampled["compressed_calls"] == 5 and sampled["error_samples"] == 2
    assert 0 < sampled["error_mean"] <= sampled["error_max"] < BOUND["all_reduce"]
    for site, kind in (("rs_err", "reduce_scatter"), ("ag_err", "all_gather")):
        figures = ranks[0]["stats"]["other"][site]
        assert figures["error_samples"] == 1 and 0 < figures["error_mean"] < BOUND[kind], figures
    assert ranks[0]["stats"]["off"] == 0 and ranks[0]["stats"]["empty"] == {}


def test_requires_grad_strided_and_input_errors(ranks):
    ranks = _view(ranks, "misc")
    misc = ranks[0]["misc"]
    assert misc["grad"] == [False] * 4
    assert misc["strided"]
    assert "divisible by the group size" in misc["rs_rows"]
    assert "0-d" in misc["ag_0d"]
    assert all(p["misc"]["p2p"] and p["misc"]["p2p_all_reduce"] for p in ranks)


def test_autotune_same_decision_on_every_rank(ranks):
    ranks = _view(ranks, "autotune")
    for per_rank in ranks:
        assert per_rank["autotune"] == ranks[0]["autotune"]  # every figure, not only the verdict
    got = ranks[0]["autotune"]
    assert [t["kind"] for t in got["real"]] == ["all_reduce", "all_gather"]
    assert all(t["plain_s"] > 0 and t["compressed_s"] > 0 for t in got["real"])
    assert got["faster"]["compress"] and got["faster"]["compressed_s"] == 0.9
    assert not got["within_margin"]["compress"]  # 4% faster is within the 5% margin: plain
    assert not got["one_rank_slow"]["compress"] and got["one_rank_slow"]["compressed_s"] == 3.0  # the slowest rank


def test_chunked_collectives_equal_the_one_shot_ones(ranks):
    ranks = _view(ranks, "chunked")
    world = len(ranks)
    for rank, per_rank in enumerate(ranks):
        for rec in per_rank["chunked"]:
            assert rec["order"] == [rank, *(r for r in range(world) if r != rank)], rec  # own part first
            assert rec["gather_same"], rec  # bit for bit, compressed too (same groups, same codec)
            assert rec["compressed"] == ((1, 1) if rec["label"] == "compressed" else (0, 0)), rec
            if rec["label"] == "compressed" or world == 2:
                assert rec["scatter_same"], rec  # the same buffers summed in rank order
            else:  # a plain reduction may add in another order than reduce_scatter: a rounding or two
                assert rec["scatter_ulps"] <= 2, rec
    _same_across([p["chunked"] for p in ranks], list(range(world)))


def test_emulated_group_runs_the_per_rank_kinds_with_the_real_bytes(ranks):
    """`EmulatedGroup` runs the per-rank kinds through the same piece generators: fed every
    rank's inputs, it returns the bytes each real rank got, compressed and plain (the gather
    exactly; the plain scatter sums in rank order, as gloo's reduction does at P = 2)."""
    ranks = _view(ranks, "chunked")
    world = len(ranks)
    group = EmulatedGroup(world)
    for i, rec in enumerate(ranks[0]["chunked"]):
        cfg = None if rec["label"] == "plain" else CFG
        dtype = getattr(torch, rec["dtype"].removeprefix("torch."))
        shards = [_input(99, r, (2, 3, 70), dtype) for r in range(world)]
        gathered = group.collective("all_gather_by_rank", [s.unsqueeze(0) for s in shards], comm.Site("e", None, cfg, piece_bytes=1024))
        assert _digest(gathered) == rec["digest"], rec
        partials = [torch.stack([_input(100 + r, q, (2, 3, 70), dtype) for r in range(world)]) for q in range(world)]
        summed = group.collective("reduce_scatter_by_rank", partials, comm.Site("e", None, cfg, piece_bytes=1024))
        for rank in range(world):
            if cfg is not None or world == 2:
                assert _digest(summed[rank]) == ranks[rank]["chunked"][i]["mine_digest"], (rank, rec)


def test_collectives_in_flight_together(ranks):
    ranks = _view(ranks, "in_flight")
    assert all(per_rank["in_flight"]["same"] for per_rank in ranks)


def test_each_table_checks_and_counts_its_own_sites(ranks):
    ranks = _view(ranks, "run_state")
    for per_rank in ranks:
        state = per_rank["run_state"]
        assert "called all_reduce differently" in state["second_table"] and "elements" in state["second_table"], state
        assert state["counts"] == ({"blk/fwd": 1}, {})  # the refused call recorded nothing


def test_check_collectives_set_on_one_rank_fails_at_the_first_check(ranks):
    ranks = _view(ranks, "run_state")
    for per_rank in ranks:
        state = per_rank["run_state"]
        assert "disagree about TACO_CHECK_COLLECTIVES" in state["debug"], state["debug"]
        assert "set TACO_CHECK_COLLECTIVES to the same value on every rank" in state["debug"]
        assert state["after"] == ranks[0]["run_state"]["after"]


def test_plain_path_reads_no_data_the_options_do_not_ask_for(ranks):
    ranks = _view(ranks, "run_state")
    names = ranks[0]["run_state"]["plain_ops"]
    assert not any(n in names for n in ("isfinite", "nan_to_num", "copy_", "clone", "empty")), names


def test_steady_calls_allocate_nothing_but_a_new_output(ranks):
    ranks = _view(ranks, "run_state")
    for per_rank in ranks:
        own = per_rank["run_state"]["own"]
        assert own["plain, in place"]["collectives"] == 1 and own["plain, in place"]["allocations"] == 0, own
        assert own["compressed, in place"]["collectives"] == 2 and own["compressed, in place"]["allocations"] == 0, own
        assert own["compressed, new output"]["allocations"] == 1, own  # the result itself


def test_dtypes_the_codec_does_not_encode_go_plain_and_exact(ranks):
    """Integers (and float64) under compressing settings arrive exact: they are never compressed."""
    ranks = _view(ranks, "checks")
    for per_rank in ranks:
        got = per_rank["checks"]
        for dtype in ("torch.int64", "torch.int32", "torch.float64"):
            assert got[dtype] == {"same": True, "compressed": 0}, (dtype, got[dtype])
        assert "compress=True) of a torch.int64 tensor" in got["forced"], got["forced"]
        assert "leave compress=None" in got["forced"]


def test_later_calls_of_another_length_fail_on_every_rank(ranks):
    """Ranks whose later call at a site differs in length (the first one was checked) get a clear
    error naming the site, on every rank, not results of different shapes; the group still works."""
    ranks = _view(ranks, "checks")
    for per_rank in ranks:
        got = per_rank["checks"]
        for kind in ("all_reduce", "all_gather", "reduce_scatter"):
            assert got[kind].startswith(f"later/{kind}: "), got[kind]
            assert "message of another length" in got[kind] and "pad the batch" in got[kind], got[kind]
        assert got["after"] == ranks[0]["checks"]["after"]


def test_header_disagreement_on_the_device_is_nan_then_an_error_on_every_rank(ranks):
    """Where reading a header costs a host sync (a GPU), every received chunk's header is compared
    on the device: ranks whose later call differs in length get NaN for every value that came from
    (or was summed with) a chunk of the other length, never numbers, and a `WireFormatError`
    naming the site on every rank at the next host sync: the call's own under nonfinite="raise",
    else the statistics' pop (the training loops pop every step, taco_trainer at each log). A
    matching call reads nothing back."""
    if len(ranks) != 3:
        pytest.skip("run in the world of 3")
    _assert_header_disagreement([per_rank["headers_on_device"] for per_rank in _view(ranks, "headers_on_device")])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_header_disagreement_on_a_gpu():
    """The same on CUDA tensors: two gloo ranks on one GPU (NCCL refuses two ranks on one
    device), the fused Triton codec, `codec.api.READ_AT_ONCE` as it is."""
    _assert_header_disagreement(run_ranks(_headers_on_device, 2, "cuda"))


def _assert_header_disagreement(ranks: list[dict]) -> None:
    world = len(ranks)
    for rank, per_rank in enumerate(ranks):
        for name, got in per_rank.items():
            kind, nonfinite = name.split("/")
            site = f"device/{kind}: "
            if nonfinite == "raise":
                assert got["at_call"] is not None and got["at_call"].startswith(site), (rank, name, got)
                assert "message of another length" in got["at_call"] and "pad the batch" in got["at_call"], got
                assert got["at_pop"] is None, (rank, name, got)
            else:
                assert got["host_reads"] == [], (rank, name, got)
                assert got["at_call"] is None and got["at_pop"] is not None, (rank, name, got)
                assert got["at_pop"].startswith(site) and "message of another length" in got["at_pop"], got
                if kind.startswith(("all_gather", "gather")):  # the parts of ranks of the other length
                    odd = [r != rank and (r == 0 or rank == 0) for r in range(world)]
                    assert got["nan_parts"] == odd and got["finite_parts"] == [not o for o in odd], (rank, name, got)
                else:  # every sum met a chunk of the other length
                    assert got["nan_parts"] == [True], (rank, name, got)
            assert got["pop_after"] == [f"device/{kind}"], (rank, name, got)


def test_subgroups(ranks):
    if len(ranks) != 4:
        pytest.skip("sub-groups run in the world of 4")
    ranks = _view(ranks, "subgroups")
    for kind in ("contiguous", "strided"):
        members = ranks[0]["subgroups"][kind]["members"]
        for per_rank in ranks:
            sub = per_rank["subgroups"][kind]
            assert sub["p2p"]
            for rec in sub["records"]:
                assert rec["err"] < BOUND[rec["op"]], (kind, rec)
        records = [[r for r in p["subgroups"][kind]["records"] if r["op"] != "reduce_scatter"] for p in ranks]
        _same_across(records, members)
        others = [r for r in range(4) if r not in members]
        _same_across(records, others)
    assert all(p["subgroups"]["single"] for p in ranks)


# --- single process -------------------------------------------------------------------------------


def test_wrong_config_types_name_the_fix():
    from taco_accel.codec import compress

    x = torch.ones(8)
    with pytest.raises(TypeError, match=r"pass TacoConfig\(format='e4m3'\)"):
        compress(x, "e4m3")
    with pytest.raises(TypeError, match=r"TacoConfig\(\*\*config\)"):
        comm.all_reduce(x, config={"group_size": 32})
    with pytest.raises(TypeError, match="not a TacoConfig"):
        EmulatedGroup(2).all_gather([x, x], "on")
    with pytest.raises(TypeError, match="pass True, False or None"):
        comm.all_reduce(x, None, CFG, compress="yes")


def test_environment_settings_are_checked(monkeypatch):
    from taco_accel import EnvironmentSettingError
    from taco_accel.comm import agreement
    from taco_accel.parallel.mesh import collective_timeout

    monkeypatch.setenv("TACO_CHECK_COLLECTIVES", "maybe")
    agreement.debug.cache_clear()
    try:
        with pytest.raises(EnvironmentSettingError, match=r"TACO_CHECK_COLLECTIVES='maybe' is not a switch; set it to 1"):
            agreement.debug()
        monkeypatch.setenv("TACO_CHECK_COLLECTIVES", "1")
        agreement.debug.cache_clear()
        assert agreement.debug()
    finally:
        monkeypatch.delenv("TACO_CHECK_COLLECTIVES")
        agreement.debug.cache_clear()
    for bad in ("inf", "nan", "-3", "ten"):
        monkeypatch.setenv("TACO_TIMEOUT_S", bad)
        with pytest.raises(EnvironmentSettingError, match=f"TACO_TIMEOUT_S='{bad}'.*set e.g. TACO_TIMEOUT_S=1800"):
            collective_timeout()


# --- the piece schedule (no ranks needed) --------------------------------------------------------


def test_piece_bounds_and_length():
    assert piece_bounds(10, 0) == [(0, 10)] and piece_bounds(10, 10) == [(0, 10)]
    assert piece_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert piece_length(0, 2, 256) == 0  # no split
    assert piece_length(2**20, 2, 256) == 2**19  # 1 MiB of bf16
    assert piece_length(1000, 2, 256) == 256  # at least one aligned unit
    assert piece_length(3000, 4, 256) == 512  # rounded down to the alignment


def test_pipeline_order():
    """Each piece is advanced once per tick, newest first, so piece k+1 encodes before k waits."""
    log = []

    def piece(k):
        log.append(f"encode{k}")
        yield
        log.append(f"reduce{k}")
        yield
        log.append(f"decode{k}")

    Pipeline(piece(k) for k in range(3)).wait()
    assert log == [
        "encode0",
        "encode1", "reduce0",
        "encode2", "reduce1", "decode0",
        "reduce2", "decode1",
        "decode2",
    ]
