"""The sizes a `taco_accel.Accelerator` lays its mesh out with (`integrations.sizes`), in one
process: Accelerate's ``ParallelismConfig`` read by Accelerate's own rules for 4 processes,
one process's emulated TP, the ``ParallelismConfig`` describing a mesh, the collective timeout."""

from __future__ import annotations

import datetime

import pytest
from accelerate import ParallelismConfig
from accelerate.utils import InitProcessGroupKwargs
from packaging.version import Version

from taco_accel.integrations import sizes
from taco_accel.parallel import ParallelDims
from taco_accel.upstream import accelerate as up_accelerate


def test_sizes_that_do_not_cover_the_processes_raise_as_accelerate_does():
    with pytest.raises(ValueError, match=r"total_size \(2\) does not match num_processes \(4\)") as raised:
        sizes.dims_from_config(ParallelismConfig(tp_size=2), None, 4)
    assert "pp_size" in str(raised.value)  # the other way to cover the processes


def test_all_sizes_one_is_data_parallelism_over_every_process():
    assert str(sizes.dims_from_config(ParallelismConfig(), None, 4)) == "pp=1 x dp=4 (ddp) x tp=1"


def test_tp_with_replicated_dp():
    # Accelerate's own check at construction: 1.15 refuses tp with replicated dp, 1.16 allows it
    # (the README names the launch config instead, which taco_accel reads itself)
    if Version(up_accelerate.check_version()) < Version("1.16"):
        with pytest.raises(ValueError, match="Tensor/Context parallelism"):
            ParallelismConfig(tp_size=2, dp_replicate_size=2)
        return
    dims = sizes.dims_from_config(ParallelismConfig(tp_size=2, dp_replicate_size=2), None, 4)
    assert str(dims) == "pp=1 x dp=2 (ddp) x tp=2"


def test_unsupported_axes_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match="cp_size=2.*set them to 1"):
        sizes.dims_from_config(ParallelismConfig(cp_size=2, dp_shard_size=2), None, 4)


def test_one_process_emulates_tp():
    dims, emulated = sizes.mesh_sizes(None, ParallelismConfig(tp_size=2), None, 1)
    assert (dims.world_size, emulated) == (1, 2)
    dims, emulated = sizes.mesh_sizes(ParallelDims(dp=2, tp=2), None, None, 4)  # real processes: no emulation
    assert (str(dims), emulated) == ("pp=1 x dp=2 (ddp) x tp=2", 1)


def test_the_description_is_the_replicas_by_their_mode():
    """What transformers' Trainer and TRL read: the dp replicas (FSDP2 shards or DDP replicas), every
    rank of a replica counted once, on every supported Accelerate (1.15 refuses tp with replicated
    dp: there is no tp in it)."""
    fsdp = sizes.describe(ParallelDims(dp=2, tp=2, dp_mode="fsdp"))
    ddp = sizes.describe(ParallelDims(pp=2, dp=2, tp=2))
    assert (fsdp.dp_shard_size, fsdp.dp_replicate_size, fsdp.tp_size) == (2, 1, 1)
    assert (ddp.dp_shard_size, ddp.dp_replicate_size, ddp.tp_size) == (1, 2, 1)
    for config in (fsdp, ddp, sizes.describe(ParallelDims(tp=2))):
        # total_size = num_processes; what the Trainer divides a shared batch's counts by: 1
        assert (config.total_size, config.non_data_parallel_size) == (config.data_parallel_size, 1)
        assert not (config.tp_enabled or config.cp_enabled or config.sp_enabled)


def test_the_timeout_given_wins_else_the_default_is_added(monkeypatch):
    monkeypatch.setenv("TACO_TIMEOUT_S", "7")
    kwargs = {}
    assert sizes.with_timeout(kwargs) == datetime.timedelta(seconds=7)
    (handler,) = kwargs["kwargs_handlers"]  # so that Accelerate's world group waits as long
    assert handler.timeout == datetime.timedelta(seconds=7)
    given = {"kwargs_handlers": [InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=3))]}
    assert sizes.with_timeout(given) == datetime.timedelta(seconds=3)
