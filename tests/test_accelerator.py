"""A user's own Accelerate loop with `taco_accel.Accelerator`, started by ``accelerate launch``
like a user would, against the same training on one process: tp=2, dp=2 x tp=2 (DDP replicas)
and dp=2 x tp=2 with FSDP2; compression off (equal to fp32 rounding) and on (within the codec's
bound); resume from ``save_state``; ``gather_for_metrics``; ``save_model``; the unsafe paths.

Each mesh's launch runs every check (`accelerate_loop_worker.py`), each check's error kept as
its own result; the launch is shared with the other modules that train on that mesh
(tests/launches.py: a launch's start-up is most of its time).
"""

from __future__ import annotations

import launches
import pytest

# The 4-process launch runs dp=2 x tp=2 with the launch config's sizes, then FSDP2 dp=2 x tp=2
# with sizes given as Accelerator(parallelism_config=...)
CHECKS = {"tp2": "parity,resume,metrics,refusals,wire,bf16", "dp2_tp2": "parity,fsdp_parity,resume,metrics,wire"}
MESHES = list(CHECKS)
# (launch, its checks of compression off and on) of each mesh
PARITY = {"tp2": ("tp2", "off", "on"), "dp2_tp2": ("dp2_tp2", "off", "on"), "fsdp2_tp2": ("dp2_tp2", "fsdp_off", "fsdp_on")}
for _mesh, _checks in CHECKS.items():
    launches.register(f"accelerator_{_mesh}", _mesh, "accelerate_loop_worker", lambda _, c=_checks: ["--checks", c])


@pytest.fixture(scope="module")
def launched(shared_launches):
    """Each mesh's results, launched when a test first asks for it."""
    def get(mesh: str) -> dict:
        result = shared_launches(mesh)[f"accelerator_{mesh}"]
        assert "launch_error" not in result, result["launch_error"]
        return result

    return get


@pytest.fixture(params=list(PARITY))
def parity(request, launched):
    """(mesh, figures with compression off, figures with compression on)."""
    launch, off, on = PARITY[request.param]
    result = launched(launch)
    return request.param, _check(result, off), _check(result, on)


@pytest.fixture(params=list(MESHES))
def run(request, launched):
    return request.param, launched(request.param)


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


@pytest.mark.parametrize("case", ["clip", "no_clip", "fp16"])
def test_a_wire_error_reaches_the_loop_at_the_optimizer_step_on_every_rank(run, case):
    """A compressed chunk of another config (one rank changed a site's format at step 2; the
    header reads deferred as on a GPU): the optimizer step of that step raises a WireFormatError
    on every rank, before it uses the NaN values (fp16: the scaler does not skip it silently),
    naming the site where a rank received the chunk (the other tp group's ranks: another rank's);
    each step before reads the host once in clipping and the step together (fp16: the scaler's
    own read)."""
    name, result = run
    ranks = _check(result, "wire")[case]
    for rank, got in enumerate(ranks):
        assert got["step"] == 2 and got["type"] == "WireFormatError", (rank, got)
        assert got["unchanged"] and got["reads"] == [1, 1], (rank, got)  # the weights kept
        assert got["nan_loss"] == (rank < 2), (rank, got)  # the other replica's loss is its own
        if rank < 2:  # the tp group that exchanged the chunk
            assert got["message"].startswith("layers.0.mlp.down_proj/fwd: "), (rank, got)
            assert "another TacoConfig" in got["message"] and "values were read as NaN" in got["message"], got
        else:
            assert "another rank received" in got["message"], (rank, got)
        assert "every rank must send the same shape" in got["message"], got


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
def test_bf16_mixed_precision_trains_like_one_process(launched, layout):
    r = _check(launched("tp2"), "bf16")[layout]
    assert len(r["losses"]) == 6, r
    assert max(abs(a - b) / b for a, b in zip(r["losses"], r["ref_losses"])) < BF16_LOSS, r
    assert max(abs(a - b) / b for a, b in zip(r["grad_norms"][:3], r["ref_grad_norms"][:3])) < BF16_NORM, r
