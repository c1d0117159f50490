"""Pipeline stage boundaries through the codec (`taco_accel.parallel.boundary`) on 2 gloo ranks,
the recipes' `Trainer` on the nano Qwen2 preset, tp=1: only the boundaries' sites exist.

Compressed, every schedule is compared bit for bit with one process that puts the same codec round
trip at the same stage cuts (`emulate_boundaries`): the stages compute exactly what the one
process computes (with compression off, test_pipeline.py checks that bit for bit), so the same
bytes reach the codec on both sides and no FP8 rounding can flip between them. Each message is
then checked against the codec's own bound (sampled on the sender), its bytes counted per site.
Compression off is test_pipeline.py's (bit-identical to one process); dp x pp x tp is
test_parallel_3d.py's. One launch for every case (`harness.per_case`).
"""

from __future__ import annotations

import functools
import json
import math
import os

import pytest
import torch.distributed as dist

from harness import UNIT, case, per_case, run_ranks, timed_verdicts
from test_pipeline import STEPS, _resume_case, reference, trainer

G = 32  # divides the nano preset's hidden size (32)
MICRO = 2  # micro-batches per step, of micro_batch_size=2 windows of seq_len=32 tokens
MESSAGE = (2, 32, 32)  # one boundary message: (windows, tokens, hidden), fp32
# The codec's worst case for one group, relative in L2 (tests/test_codec.py worst_case_error):
# E4M3 rounding to nearest moves a normal value by at most 2**-4 of itself, a subnormal by half a
# subnormal step (2**-10 of the scale) while the group's norm is at least 448 steps of it; over
# all groups (sum of squares) the same bound holds for the whole message; plus the fp32 rounding
# of the transform and the scales (a few units per value, bounded by 64 units).
CODEC = 2.0**-4 + math.sqrt(G) * 2.0**-10 / 448 + 64 * UNIT
SCHEDULES = {"gpipe": 2, "1f1b": 2, "interleaved_1f1b": 4}  # schedule -> stages (2 per rank when interleaved)


def _codec(**fields):
    from taco_accel import TacoConfig

    return TacoConfig(group_size=G, **fields)  # threshold 0: the nano messages are tiny


def _shared(out: str) -> str:
    """A folder every rank names alike (the main rank writes the run's files there)."""
    dist.barrier()
    return out


def _compressed(out: str, cache: str, schedule: str) -> dict:
    """Train with every boundary compressed; then one more step with the error of every message
    sampled, returning this rank's per-site figures."""
    from taco_accel import comm

    run = trainer(_shared(out), cache, pp=2, schedule=schedule, compression=_codec())
    rows = [(r["loss"], r["comm_bytes_sent"], r["comm_bytes_saved"]) for r in run.train()]
    dist.barrier()
    with open(os.path.join(out, "compression.json")) as f:
        decisions = json.load(f)
    inputs, labels = run.batches.batch(run.step)
    comm.set_error_sampling(1)
    try:
        run.pipe.step(inputs, labels)
    finally:
        comm.set_error_sampling(0)
    sites = {name: s.to_dict() for name, s in comm.pop_comm_stats().items()}
    return {"rows": rows, "decisions": decisions, "sites": sites}


def _auto(out: str, cache: str) -> dict:
    """Auto mode, the link's timing forced to favour compression (its exchanges still run)."""
    from taco_accel import Compression

    with timed_verdicts(lambda kind, x, config: kind == "send"):
        run = trainer(_shared(out), cache, pp=2, compression=Compression("auto", _codec(), _codec()))
        rows = [(r["loss"], r["comm_bytes_sent"], r["comm_bytes_saved"]) for r in run.train()]
    dist.barrier()
    with open(os.path.join(out, "compression.json")) as f:
        return {"rows": rows, "decisions": json.load(f)}


def _error(call) -> dict:
    try:
        call()
        return {"type": None, "message": ""}
    except Exception as error:  # the test asserts on the type
        return {"type": type(error).__name__, "message": str(error)}


def _disagreeing(out: str, cache: str, rank1) -> dict:
    """Rank 1 configures the boundaries differently from rank 0: the first step must fail on both."""
    compression = rank1 if dist.get_rank() == 1 else _codec()
    return _error(lambda: trainer(os.path.join(out, str(dist.get_rank())), cache, pp=2, compression=compression)
                  .train())


def _nonfinite(out: str, cache: str) -> dict:
    """Stage 0 (rank 0) produces a NaN activation under nonfinite='raise'."""
    run = trainer(os.path.join(out, str(dist.get_rank())), cache, pp=2, compression=_codec(nonfinite="raise"))
    if dist.get_rank() == 0:
        def poison(module, args, output):
            output = output.clone()
            output[0, 5, 7] = float("nan")
            return output

        run.parts.modules[0].register_forward_hook(poison)
    return _error(run.train)


def _suite(out: str, cache: str) -> dict:
    from taco_accel import Compression

    path = functools.partial(os.path.join, out)
    cases = {f"on_{s}": functools.partial(_compressed, path(s), cache, s) for s in SCHEDULES}
    cases["auto"] = functools.partial(_auto, path("auto"), cache)
    cases["resume"] = functools.partial(_resume_case, out, cache, "boundaries", dict(pp=2, compression=_codec()))
    cases["mismatch_group_size"] = functools.partial(_disagreeing, path("g"), cache, _codec().replace(group_size=64))
    cases["mismatch_mode"] = functools.partial(_disagreeing, path("m"), cache, Compression("auto", _codec(), _codec()))
    cases["nonfinite"] = functools.partial(_nonfinite, path("nan"), cache)
    return per_case(cases)


@pytest.fixture(scope="module")
def suite(tmp_path_factory, token_cache):
    out = tmp_path_factory.mktemp("boundaries")
    return run_ranks(_suite, 2, str(out), token_cache), token_cache


def _emulated(cache: str) -> dict:
    """One process, pp=1: the boundary codec at the cuts of 2 and of 4 stages (`emulate_boundaries`)."""
    import tempfile

    from taco_accel.parallel import emulate_boundaries

    out = {}
    for stages in sorted(set(SCHEDULES.values())):
        with tempfile.TemporaryDirectory() as folder:
            run = trainer(folder, cache, pp=1, dp=1, tp=1)
            emulate_boundaries(run.model, stages, _codec(), seq_len=32)
            out[stages] = [r["loss"] for r in run.train()]
    return out


@functools.lru_cache(maxsize=None)
def emulated(cache: str) -> dict:
    return run_ranks(_emulated, 1, cache)[0]


def _same_on_every_rank(suite, name: str):
    ranks = case(suite[0], name)
    assert all(r["rows"] == ranks[0]["rows"] for r in ranks), ranks
    return ranks


def _wire() -> int:
    from taco_accel.codec import WireLayout

    return WireLayout.for_tensor(math.prod(MESSAGE), _codec()).total_bytes


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_compressed_boundaries_equal_one_process_with_the_codec_at_the_cuts(suite, schedule):
    rows = _same_on_every_rank(suite, f"on_{schedule}")[0]["rows"]
    assert [r[0] for r in rows] == emulated(suite[1])[SCHEDULES[schedule]]
    assert [r[0] for r in rows] != list(reference(suite[1]))  # the codec really ran


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_boundary_bytes_and_decisions(suite, schedule):
    ranks = _same_on_every_rank(suite, f"on_{schedule}")
    cuts = SCHEDULES[schedule] - 1
    plain = 4 * math.prod(MESSAGE)
    # every step: each cut sends one activation and one gradient per micro-batch, nothing else
    for _, sent, saved in ranks[0]["rows"]:
        assert sent == 2 * cuts * MICRO * _wire()
        assert saved == 2 * cuts * MICRO * (plain - _wire())
    decisions = ranks[0]["decisions"]
    names = {f"pp.{b}-{b + 1}/{d}" for b in range(cuts) for d in ("fwd", "bwd")}
    assert set(decisions) == names
    assert all(d["mode"] == "on" and d["compressed"] and d["config"]["group_size"] == G for d in decisions.values())


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_each_boundary_message_within_the_codec_bound_counted_on_its_sender(suite, schedule):
    ranks = case(suite[0], f"on_{schedule}")
    cuts = SCHEDULES[schedule] - 1
    for rank, r in enumerate(ranks):
        # stage b runs on rank b % 2: it sends the activations of cut b and the gradients of cut b - 1
        mine = {f"pp.{b}-{b + 1}/fwd" for b in range(cuts) if b % 2 == rank}
        mine |= {f"pp.{b}-{b + 1}/bwd" for b in range(cuts) if (b + 1) % 2 == rank}
        assert set(r["sites"]) == mine
        for name, s in r["sites"].items():
            assert s["calls"] == s["compressed_calls"] == MICRO, (name, s)
            assert s["bytes_sent"] == MICRO * _wire() and s["bytes_uncompressed"] == MICRO * 4 * math.prod(MESSAGE)
            assert s["error_samples"] == MICRO and 0 < s["error_max"] <= CODEC, (name, s)


def test_auto_sends_plain_until_the_link_is_timed_after_the_first_step(suite):
    r = _same_on_every_rank(suite, "auto")[0]
    plain = 4 * math.prod(MESSAGE)
    assert [saved for _, _, saved in r["rows"]] == [0] + [2 * MICRO * (plain - _wire())] * (STEPS - 1)
    for name in ("pp.0-1/fwd", "pp.0-1/bwd"):
        d = r["decisions"][name]
        assert d["mode"] == "auto" and d["compressed"] and d["decision"]["rule"] == "timed", d
        assert d["decision"]["kind"] == "send" and d["decision"]["nbytes"] == plain, d


def test_resume_with_compressed_boundaries_repeats_the_uninterrupted_losses(suite):
    ranks = case(suite[0], "resume")
    assert all(r == ranks[0] for r in ranks)
    straight, first, resumed = ranks[0]
    assert first == straight[:2]
    assert resumed == straight


@pytest.mark.parametrize("name, field", [("mismatch_group_size", "group_size"), ("mismatch_mode", "mode")])
def test_ranks_that_disagree_about_a_boundary_raise_on_both_ends(suite, name, field):
    for r in case(suite[0], name):
        assert r["type"] == "CollectiveMismatch", r
        assert "pp.0-1/fwd" in r["message"] and field in r["message"], r["message"]


def test_a_nonfinite_activation_under_raise_fails_every_rank_after_the_step(suite):
    for r in case(suite[0], "nonfinite"):
        assert r["type"] == "NonFiniteError", r
        assert "pp.0-1/fwd" in r["message"] and "pp.0-1/bwd" not in r["message"], r["message"]
