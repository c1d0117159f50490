"""A user's own Accelerate loop with `taco_accel.Accelerator`, started by ``accelerate launch``
like a user would, against the same training on one process: tp=2, dp=2 x tp=2 (DDP replicas)
and dp=2 x tp=2 with FSDP2; compression off (equal to fp32 rounding) and on (within the codec's
bound); resume from ``save_state``; ``gather_for_metrics``; ``save_model``; the unsafe paths.

One launch per mesh runs every check (`accelerate_loop_worker.py`), each check's error kept
as its own result; the launches take most of this module's time (process start-up and imports).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import run_command

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("accelerate_loop_worker.py")

# one launch per process count (the start-up of the processes is most of the time): the 4-process
# launch runs dp=2 x tp=2 with the launch config's sizes, then FSDP2 dp=2 x tp=2 with sizes given as
# Accelerator(parallelism_config=...)
MESHES = {
    "tp2": (2, {"parallelism_config_tp_size": 2}),
    "dp2_tp2": (4, {"parallelism_config_tp_size": 2, "parallelism_config_dp_replicate_size": 2}),
}
CHECKS = {"tp2": "parity,resume,metrics,refusals,bf16", "dp2_tp2": "parity,fsdp_parity,resume,metrics"}
# (launch, its checks of compression off and on) of each mesh
PARITY = {"tp2": ("tp2", "off", "on"), "dp2_tp2": ("dp2_tp2", "off", "on"), "fsdp2_tp2": ("dp2_tp2", "fsdp_off", "fsdp_on")}


def launch_config(path: Path, processes: int, sizes: dict) -> Path:
    """An accelerate config as `accelerate config` writes it: CPU processes started by torchrun."""
    lines = ["compute_environment: LOCAL_MACHINE", "distributed_type: MULTI_GPU", "use_cpu: true",
             "num_machines: 1", f"num_processes: {processes}", "machine_rank: 0", "mixed_precision: 'no'",
             "rdzv_backend: static", "same_network: true", f"main_process_port: {_free_port()}",
             "parallelism_config:"] + [f"  {k}: {v}" for k, v in sizes.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(**extra: str) -> dict:
    """This environment without a parent launch's rank variables, one thread per process, this
    checkout first on the path (then the caller's PYTHONPATH), no GPU visible; plus ``extra``.
    No GPU: every launched script is a CPU test, and a one-process run of transformers' Trainer
    takes ``cuda:0`` whenever CUDA is available, ``ACCELERATE_USE_CPU`` or not (its
    ``TrainingArguments`` choose a one-process run's device from ``use_cpu`` alone, 5.10 to 5.25),
    so that a reference on a GPU box would train in other arithmetic than the ranks it is compared
    with."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=path, CUDA_VISIBLE_DEVICES="", **extra)
    return env


def accelerate_launch(config: Path, script: Path, *args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), str(script), *args]
    return run_command(cmd, env=launch_env(**(env or {})), cwd=cwd)


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict:
    """Each launch's results, launched when a test first asks for it."""
    done = {}

    def get(name: str) -> dict:
        if name not in done:
            tmp = tmp_path_factory.mktemp(name)
            processes, sizes = MESHES[name]
            out = accelerate_launch(launch_config(tmp / "config.yaml", processes, sizes), WORKER,
                                    "--out", str(tmp / "out.json"), "--checks", CHECKS[name], cwd=tmp)
            assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
            done[name] = json.loads((tmp / "out.json").read_text())
        return done[name]

    return get


@pytest.fixture(params=list(PARITY))
def parity(request, launches):
    """(mesh, figures with compression off, figures with compression on)."""
    launch, off, on = PARITY[request.param]
    result = launches(launch)
    return request.param, _check(result, off), _check(result, on)


@pytest.fixture(params=list(MESHES))
def run(request, launches):
    return request.param, launches(request.param)


def _check(result: dict, key: str) -> dict:
    """The figures of one check of the launch; that check's own error if it raised."""
    r = result[key]
    assert "error" not in r, r["error"]
    return r


def test_compression_off_equals_one_process(parity):
    name, r, _ = parity
    assert r["local_gate_rows"] == (32 if name == "fsdp2_tp2" else 64)  # 128 rows / tp 2 (/ 2 FSDP shards)
    assert r["keys_equal"]
    # fp32 losses of about 5.5 (ulp 4.8e-7): the runs differ only in the order of fp32 sums, a
    # few ulps of each loss; AdamW's steps carry that only through coordinates the loss barely
    # feels (see below): 2e-5, 40 ulps
    assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) < 2e-5
    assert max(abs(a - b) / b for a, b in zip(r["grad_norms"], r["ref_grad_norms"])) < 1e-5
    assert r["lrs"] == pytest.approx(r["ref_lrs"], rel=1e-12)  # the schedule steps once per replica
    # The trained weights are compared through the loss they give, not element by element: AdamW
    # normalises each gradient, so a coordinate whose gradient is rounding noise (k_proj's bias,
    # to which attention is invariant: exact gradient 0) moves by up to lr per step on either
    # side, a difference no fp32 bound covers but one that moves the loss by ~g * dw ~ 0. The
    # saved model's losses on every batch of the run: the same bound as the step losses.
    assert max(abs(a - b) for a, b in r["final_losses"]) < 2e-5, r["final_losses"]
    assert r["saved_model_diff"] == 0.0  # save_model and model.save_pretrained wrote the gathered weights
    assert r["bytes_saved"] == 0.0
    assert len(r["losses"]) == 6
    assert r["distinct_batches"] == 6 * 2  # 6 steps x 2 micro-batches: no global batch repeats


def test_compression_on_stays_within_the_codec_bound(parity):
    _, _, r = parity
    rel = [abs(a - b) / b for a, b in zip(r["losses"], r["ref_losses"])]
    assert rel[0] < 5e-3 and max(rel) < 2e-2, rel
    assert r["losses"] != pytest.approx(r["ref_losses"], abs=1e-7)  # the codec really ran
    assert r["bytes_saved"] > r["bytes_sent"]  # fp32 training: about a quarter of the plain bytes are sent


def test_save_state_resume_repeats_the_losses(run):
    name, result = run
    if "resume" not in result:
        pytest.skip(f"{name} runs parity only")
    r = _check(result, "resume")
    assert r["resumed"] == r["straight"][3:]  # steps 4-6, bit for bit
    assert "taco_checkpoint.json" in r["files"]


def test_gather_for_metrics_covers_the_set_once(run):
    name, result = run
    if "metrics" not in result:
        pytest.skip(f"{name} runs parity only")
    r = _check(result, "metrics")
    assert r["seen"] == list(range(13))  # over dp only, the padding dropped
    replicas = 2 if name == "dp2_tp2" else 1
    assert r["reduce_sum"] == replicas and r["reduce_mean"] == (replicas - 1) / 2  # the replicas' indices 0 .. dp-1
    assert r["objects"] == list(range(replicas))  # one object per replica, its tp ranks counted once
    assert r["refused"] == "reduction='max': use 'sum', 'mean' or 'none'"


def test_unsafe_paths_fail_loudly(run):
    name, result = run
    if "refusals" not in result:
        pytest.skip(f"{name} runs parity only")
    r = _check(result, "refusals")
    plain, mismatch = r["plain"], r["mismatch"]
    assert plain is not None and "tensor-parallel" in plain and "from taco_accel import Accelerator" in plain, plain
    assert "taco_accel.taco_trainer(Trainer)" in plain, plain  # the door for a Trainer user (--multi_gpu)
    assert mismatch is not None and "tp=2" in mismatch and "tp=1" in mismatch, mismatch


# bf16 autocast, 6 AdamW steps, against one process under the same autocast. The bound is
# tests/test_precision.py's: two runs rounding to bf16 at different points differ in relative rms
# by u (sqrt N_a + sqrt N_b) / sqrt 3 (u = 2**-8), N the roundings on the path, which
# test_precision counts at under 100 per forward and 200 per forward and backward in models of this
# size: 0.045 for the loss (a mean of per-token functions of the logits, it moves less than they do)
# and 0.065 for the gradient norms (measured: 3e-6 to 9e-4; 5e-5 to 2.4e-3 over steps 1-3). The
# loss bound holds after the updates: AdamW's steps are equal where gradients are not rounding
# noise, and where they are (lr 1e-2 either way per step) the loss barely feels them (see
# test_compression_off_equals_one_process); the gradient norms of such different weights are
# compared before they drift: steps 1-3.
BF16_LOSS, BF16_NORM = 2 * 2.0**-8 * (100 / 3) ** 0.5, 2 * 2.0**-8 * (200 / 3) ** 0.5


@pytest.mark.parametrize("layout", ["tp", "sp"])
def test_bf16_mixed_precision_trains_like_one_process(launches, layout):
    r = _check(launches("tp2"), "bf16")[layout]
    assert len(r["losses"]) == 6, r
    assert max(abs(a - b) / b for a, b in zip(r["losses"], r["ref_losses"])) < BF16_LOSS, r
    assert max(abs(a - b) / b for a, b in zip(r["grad_norms"][:3], r["ref_grad_norms"][:3])) < BF16_NORM, r
