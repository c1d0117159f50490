"""transformers' ``Trainer`` and TRL's ``SFTTrainer`` through `taco_accel.taco_trainer`, started as
a user starts them, against the plain classes on one process on the same global batches.

Two launches of tests/hf_trainer_worker.py: ``torchrun`` on 2 gloo processes with
``TrainingArguments(parallelism_config=ParallelismConfig(tp_size=2))``, and ``accelerate launch``
with a dp=2 x tp=2 config (4 processes, the sizes from the launch config: Accelerate 1.15's
``ParallelismConfig`` refuses tp with replicated dp when built in Python; a job of the launch that
tests/launches.py shares with the other modules on that mesh); one plain process runs
the reference for dp=1 and dp=2 meanwhile. Each launch runs several trainings; the worker
records each one's figures or its traceback, and each test reads its own. Every training is
compared step by step: losses, gradient norms, learning rates and the logged token counts
(the Trainer's ``num_input_tokens_seen``, TRL's ``num_tokens``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import launches
import pytest
from harness import finish_command, run_command, start_command

WORKER = Path(__file__).with_name("hf_trainer_worker.py")
BATCH, ACCUM = 2, 2  # the worker's per-device batch and accumulation
# fp32, compression off: TP sums partial products in another order than one process. The loss
# (about 5.5, ulp 4.8e-7) and gradient norms then differ by a few ulps per step; 4 AdamW steps
# (lr <= 3e-3) keep that at the 1e-6 level: bounds of 2e-5 absolute on losses, 1e-5 relative on norms.
LOSS_TOL, NORM_RTOL = 2e-5, 1e-5
SETTINGS = ("smoothed", "loss_func", "sft_settings", "sft_assistant", "dpo_variants", "dpo_sync", "dpo_losses",
            "grpo_losses")  # hf_trainer_worker.SETTINGS: the settings runs (docs/settings.md)
LAUNCHES = {  # name: (dp, runs)
    "tp2": (1, "trainer,resume,compressed,sft,lora,plain_checkpoint,patched,"
               "dpo,dpo_path,dpo_lora,dpo_compressed,checkpointed,liger,unaveraged,wire,grpo,grpo_ref,grpo_multi,"
               "rloo,kto,online_refusals," + ",".join(SETTINGS)),
    # resume of dp replicas: test_accelerator; bf16 and fp16 (tp=2, dp=2 x tp=2): test_entry_matrix
    "dp2_tp2": (2, "trainer,sft,pipeline_sizes,dpo"),
}
# dp=2 x tp=2: a job of the launch shared with the other modules on that mesh (tests/launches.py)
launches.register("hf_trainer", "dp2_tp2", "hf_trainer_worker", lambda folder: ["--dir", str(folder), "--runs", LAUNCHES["dp2_tp2"][1]])


def _torchrun(tmp: Path) -> dict:
    """tp=2 by torchrun, the sizes given as ``TrainingArguments(parallelism_config=...)`` (no launch config)."""
    out, folder = tmp / "tp2.json", tmp / "tp2"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(launches.free_port()), str(WORKER), "--out", str(out), "--dir", str(folder), "--runs",
           LAUNCHES["tp2"][1], "--sizes", "tp=2,dp_replicate=1"]
    done = run_command(cmd, env=launches.trainer_env(), cwd=tmp)
    if done.returncode != 0 or not out.exists():
        return {"launch_error": done.stdout[-3000:] + done.stderr[-6000:]}
    return {**json.loads(out.read_text()), "dir": str(folder)}


@pytest.fixture(scope="module")
def results(tmp_path_factory, shared_launches):
    tmp = tmp_path_factory.mktemp("hf_trainer")
    reference = start_command(
        [sys.executable, str(WORKER), "--out", str(tmp / "reference.json"), "--dir", str(tmp / "reference"),
         "--reference", "1,2"], env=launches.trainer_env(), cwd=tmp)
    launched = {"tp2": _torchrun(tmp), "dp2_tp2": shared_launches("dp2_tp2")["hf_trainer"]}
    log = finish_command(reference)
    assert reference.returncode == 0, log[-6000:]
    ref = json.loads((tmp / "reference.json").read_text())
    return launched, ref, tmp / "reference"


def run_of(results, launch: str, run: str) -> tuple[dict, dict]:
    """The launched run's figures and the one-process reference's for the same global batches."""
    launched, ref, _ = results
    got = launched[launch]
    assert "launch_error" not in got, got.get("launch_error")
    assert "error" not in got[run], got[run]["error"]
    dp = LAUNCHES[launch][0]
    same = {"sft": "sft", "lora": "lora", "trainer_bf16": "trainer_bf16", "sft_bf16": "sft_bf16", "dpo": "dpo",
            "dpo_path": "dpo", "dpo_compressed": "dpo", "dpo_lora": "dpo_lora", "grpo": "grpo", "grpo_ref": "grpo_ref",
            "grpo_multi": "grpo_multi", "rloo": "rloo", "kto": "kto", **{run: run for run in SETTINGS}}
    reference = ref[f"dp{dp}"].get(same.get(run, "trainer"))
    assert "error" not in reference, reference["error"]
    return got[run], reference


def assert_same_training(got: dict, ref: dict, steps: slice = slice(None)) -> None:
    assert got["steps"][steps] == ref["steps"][steps] == [1, 2, 3, 4][steps]
    assert got["lrs"][steps] == ref["lrs"][steps]  # the scheduler steps once per optimizer step
    assert got["losses"][steps] == pytest.approx(ref["losses"][steps], abs=LOSS_TOL)
    assert got["grad_norms"][steps] == pytest.approx(ref["grad_norms"][steps], rel=NORM_RTOL)


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_trainer_trains_like_one_process(results, launch):
    got, ref = run_of(results, launch, "trainer")
    assert_same_training(got, ref)
    dp = LAUNCHES[launch][0]
    # the Trainer's accelerator counts the dp replicas, as a user's loop's does, and describes them
    # (tp 1): the Trainer's own arithmetic divides by 1; the global batch is that of dp replicas
    assert got["layout"] == {"tp_size": 1, "total_batch": BATCH * ACCUM * dp, "config": [dp, 1, 1],
                             "num_processes": dp, "world_size": 2 * dp}
    assert got["input_tokens"] == ref["input_tokens"] == [BATCH * ACCUM * dp * 16 * k for k in (1, 2, 3, 4)]
    # every log line carries TACO's byte counts: 4 steps, 2 evaluations, the train summary
    assert got["comm_logged"] == 7 and got["eval"]["comm/bytes_sent"] > 0
    assert got["bytes_sent"] > 0 and got["bytes_saved"] == 0.0  # compression off: every byte sent plainly


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_trainer_trains_with_the_head_and_loss_fused(results, launch):
    """Training forwards return no logits (logits="none": the fused head and loss, whose loss
    trained like one process above); evaluation forwards return them (the metrics read them)."""
    got, _ = run_of(results, launch, "trainer")
    assert got["logits_seen"] == [[False, True], [True, False]], got["logits_seen"]


def test_activation_checkpointing_flag_trains_like_one_process(results):
    """TrainingArguments' own checkpointing flag (its name in this transformers) through taco_trainer:
    the replayed layers give the same losses as one process without it (compression off: fp32)."""
    got, ref = run_of(results, "tp2", "checkpointed")
    assert_same_training(got, ref)


def test_unaveraged_token_counts_train_like_one_process(results):
    """average_tokens_across_devices=False: each process's loss is its own tokens' mean (at tp=2 the
    batch of its replica, as one process's), not tp times it (transformers divides the count by the
    tp size its accelerator describes whether or not it was gathered: the taco trainer's describes
    the replicas, tp 1)."""
    got, ref = run_of(results, "tp2", "unaveraged")
    assert_same_training(got, ref)
    assert got["evals"] == pytest.approx(ref["evals"], abs=LOSS_TOL)  # evaluation counts the same way


def test_use_liger_kernel_is_refused_at_construction(results):
    got, _ = run_of(results, "tp2", "liger")
    assert got["refused"] and "use_liger_kernel=True" in got["refused"] and "\n" not in got["refused"], got


def test_a_wire_error_stops_training_at_its_optimizer_step_on_every_rank(results):
    """A compressed chunk of another config at optimizer step 2, with no log in the run (the
    statistics' pop, where the error used to come, never runs): train() raises a WireFormatError
    on every rank at that step, naming the site, before the optimizer takes it (global_step 2)."""
    got, _ = run_of(results, "tp2", "wire")
    for rank, r in enumerate(got["ranks"]):
        assert r["type"] == "WireFormatError" and r["step"] == 2, (rank, r)
        assert r["message"].startswith("layers.0.mlp.down_proj/fwd: ") and "another TacoConfig" in r["message"], r


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_trainer_evaluate_equals_one_process(results, launch):
    got, ref = run_of(results, launch, "trainer")
    for key in ("eval_loss", "eval_logsumexp"):  # logsumexp over the full vocabulary, not this rank's slice
        assert got["eval"][key] == pytest.approx(ref["eval"][key], abs=LOSS_TOL), key
    assert got["eval"]["eval_accuracy"] == ref["eval"]["eval_accuracy"]
    assert got["evals"] == pytest.approx(ref["evals"], abs=LOSS_TOL)  # at steps 2 and 4, during training


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_load_best_model_at_end_restores_the_best_checkpoint(results, launch):
    got, ref = run_of(results, launch, "trainer")
    # this data's evaluation loss rises from step 2 to 4: the end restores the step-2 model
    assert got["best"] == ref["best"] == "checkpoint-2"
    assert got["eval"]["eval_loss"] == got["evals"][0] < got["evals"][1]  # that model, bit for bit


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_save_model_writes_a_checkpoint_one_process_loads(results, launch):
    got, ref = run_of(results, launch, "trainer")
    final = Path(results[0][launch]["dir"]) / "trainer" / "final"
    assert {"config.json", "model.safetensors", "training_args.bin"} <= {p.name for p in final.iterdir()}
    # transformers' from_pretrained on one process, then the same loss as the reference's saved model
    assert got["loaded_eval_loss"] == pytest.approx(ref["loaded_eval_loss"], abs=LOSS_TOL)


def test_resume_from_checkpoint_repeats_the_uninterrupted_run(results):
    launch = "tp2"
    straight, _ = run_of(results, launch, "trainer")
    resumed, _ = run_of(results, launch, "resume")
    assert resumed["steps"] == [1, 2, 3, 4]  # steps 1-2 from the checkpoint's log history
    for key in ("losses", "grad_norms", "lrs"):  # steps 3-4 trained again, bit for bit
        assert resumed[key][2:] == straight[key][2:], key
    checkpoint = Path(results[0][launch]["dir"]) / "trainer" / "checkpoint-2"
    assert (checkpoint / "taco_state" / "taco_checkpoint.json").exists() and (checkpoint / "model.safetensors").exists()
    assert not (checkpoint / "optimizer.pt").exists()  # the optimizer's tp shards live in taco_state/


def test_compression_on_stays_within_the_codec_bound(results):
    got, ref = run_of(results, "tp2", "compressed")
    # E4M3 with one scale per group of 32 rounds each value to within 2^-4 of its group's
    # scale; averaged through 2 layers of a 64-wide model it moves the loss far less. The
    # project's bound for tiny models: 5e-3 relative on step 1 (the forward alone), 2e-2 after
    # updates (tests/test_parallel_3d.py, test_accelerator.py).
    rel = [abs(a - b) / b for a, b in zip(got["losses"], ref["losses"])]
    assert rel[0] < 5e-3 and max(rel) < 2e-2, rel
    assert got["losses"] != pytest.approx(ref["losses"], abs=1e-7)  # the codec really ran
    assert got["bytes_saved"] > got["bytes_sent"] > 0  # fp32 activations: about a quarter of the bytes sent
    assert got["lrs"] == ref["lrs"]


# TRL's loss comes from outputs.log_probs, not outputs.loss: the dp average must see that backward too
@pytest.mark.parametrize("launch", ["tp2", "dp2_tp2"])
def test_sft_trainer_trains_like_one_process(results, launch):
    got, ref = run_of(results, launch, "sft")
    assert_same_training(got, ref)
    assert got["bytes_sent"] > 0 and got["bytes_saved"] == 0.0
    assert got["num_tokens"] == ref["num_tokens"]  # TRL's token count: each token once
    assert got["input_tokens"] == ref["input_tokens"] and got["input_tokens"][0] > 0  # the Trainer's, non-padding
    # TRL's fused LM head on the gathered head weight: top-1 decisions on the full vocabulary
    assert got["token_accuracy"] == pytest.approx(ref["token_accuracy"], abs=1e-12)
    for key in ("eval_loss", "eval_entropy"):
        assert got["eval"][key] == pytest.approx(ref["eval"][key], abs=LOSS_TOL), key
    assert got["eval"]["eval_mean_token_accuracy"] == pytest.approx(ref["eval"]["eval_mean_token_accuracy"], abs=1e-12)


def test_sft_trainer_lora_trains_like_one_process(results):
    got, ref = run_of(results, "tp2", "lora")
    assert_same_training(got, ref)
    assert got["eval"]["eval_loss"] == pytest.approx(ref["eval"]["eval_loss"], abs=LOSS_TOL)
    from safetensors.torch import load_file

    mine = load_file(Path(results[0]["tp2"]["dir"]) / "lora" / "final" / "adapter_model.safetensors")
    theirs = load_file(results[2] / "dp1" / "lora" / "final" / "adapter_model.safetensors")
    assert sorted(mine) == sorted(theirs) and len(mine) == 2 * 5 * 2  # A and B, 5 targets, 2 layers
    for key, value in theirs.items():  # peft's format at full shapes; 4 AdamW steps of lr <= 3e-3 from equal
        assert mine[key].shape == value.shape, key  # starts: rounding-level gradients move them at most lr/step
        assert (mine[key] - value).abs().max().item() < 4 * 3e-3, key


def refusal(results, launch: str, run: str) -> str:
    """The error message a run that must be refused recorded (on rank 0)."""
    got = results[0][launch]
    assert "launch_error" not in got, got.get("launch_error")
    assert "error" not in got[run], got[run]["error"]
    assert got[run]["refused"], f"{run} was not refused"
    return got[run]["refused"]


def test_resume_from_a_one_process_checkpoint_is_refused(results):
    message = refusal(results, "tp2", "plain_checkpoint")
    assert "CheckpointError" in message and "taco_state" in message and "optimizer.pt" in message


def test_pipeline_sizes_are_refused(results):
    message = refusal(results, "dp2_tp2", "pipeline_sizes")  # tp=2 alone on 4 processes
    assert "does not match num_processes (4)" in message and "tp_size" in message
    message = results[0]["dp2_tp2"]["pipeline_sizes"]["refused_pp"]  # pipeline stages asked for
    assert message and "pipeline" in message and "pp=2" in message and "tp_size" in message


# TRL's DPOTrainer: its loss and rewards come from the fused head's per-token log-probabilities of
# the policy and of the reference model, both tensor parallel (the reference prepared by
# prepare_model(evaluation_mode=True), or the LoRA policy with its adapter switched off). The
# rewards are beta (0.5) x differences of sequence log-prob sums (at most 64 tokens of about 5.5:
# sums below 512, fp32 ulp 3.1e-5, times beta 1.5e-5): a few ulps of reordered fp32 sums stay
# within 5e-5; losses and norms as the Trainer's.
REWARD_TOL = 5e-5


@pytest.mark.parametrize("launch,run", [("tp2", "dpo"), ("tp2", "dpo_path"), ("tp2", "dpo_lora"), ("dp2_tp2", "dpo")])
def test_dpo_trainer_trains_like_one_process(results, launch, run):
    got, ref = run_of(results, launch, run)
    assert got["steps"] == ref["steps"] == [1, 2] and got["lrs"] == ref["lrs"]
    assert got["losses"][0] == pytest.approx(0.6931472, abs=LOSS_TOL)  # ln 2: the policy is its reference
    assert got["losses"] == pytest.approx(ref["losses"], abs=LOSS_TOL)
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=NORM_RTOL)
    assert got["num_tokens"] == ref["num_tokens"]  # TRL's token count: each token once
    for mine, theirs in zip(got["rewards"], ref["rewards"]):
        assert mine == pytest.approx(theirs, abs=REWARD_TOL)


def test_dpo_trainer_with_compression_stays_within_the_codec_bound(results):
    got, ref = run_of(results, "tp2", "dpo_compressed")
    # the compressed-run bounds of test_compression_on_stays_within_the_codec_bound: 5e-3
    # relative on step 1 (the forward alone), 2e-2 after an update
    assert got["losses"][0] == pytest.approx(ref["losses"][0], rel=5e-3)
    assert got["losses"][1] == pytest.approx(ref["losses"][1], rel=2e-2)
    assert got["bytes_saved"] > got["bytes_sent"] > 0


def test_a_plain_trainer_on_a_replaced_accelerator_is_refused_on_every_rank(results):
    message = refusal(results, "tp2", "patched")  # on main it trained with loss 0.0 and grad norm 0.0
    assert "ValueError" in message and "taco_trainer(Trainer)(model=..., args=...)" in message
    assert "from the main process alone" in message
    assert results[0]["tp2"]["patched"]["every_rank"] == [message] * 2


# TRL's online trainers: the completions the tp=2 model samples (the same RNG draws on every rank and
# in one process, from logits that differ by fp32 rounding) are one process's; each reward is a
# function of their text (equal), and the logged reward is their mean over the replicas' rows, summed
# in another order: within 32 fp32 ulps of 1. Losses and norms within the Trainer's fp32 bounds:
# policy losses are means of advantage-weighted ratios (|loss| < 1e-1 here), so the absolute bound
# LOSS_TOL holds a fortiori. Before the tp ranks' copies were gathered once: "grpo" trained other
# prompts at step 2 (TRL's generation_batch_size counted both processes), "grpo_ref", "grpo_multi"
# and "rloo" took batch statistics over both copies (Bessel's n - 1 over 2n rows).
REWARD_MEAN_TOL = 32 * 2.0**-23


@pytest.mark.parametrize("run", ["grpo", "grpo_ref", "grpo_multi", "rloo"])
def test_grpo_and_rloo_trainers_train_like_one_process(results, run):
    got, ref = run_of(results, "tp2", run)
    assert got["completions"] == ref["completions"] and len(got["completions"]) == 16
    # generation_batch_size: what the one replica generates (TRL counted both processes: 32)
    assert got["generation_batch_size"] == ref["generation_batch_size"] == 16
    assert got["steps"] == ref["steps"] == [1, 2] and got["lrs"] == ref["lrs"]
    assert got["rewards"] == pytest.approx(ref["rewards"], abs=REWARD_MEAN_TOL)
    assert got["losses"] == pytest.approx(ref["losses"], abs=LOSS_TOL)
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=NORM_RTOL)
    assert got["num_tokens"] == ref["num_tokens"]  # prompt and completion tokens, each once
    if run != "rloo":
        assert got["entropy"] == pytest.approx(ref["entropy"], abs=LOSS_TOL)


def test_kto_trainer_trains_like_one_process(results):
    got, ref = run_of(results, "tp2", "kto")
    assert got["steps"] == ref["steps"] == [1, 2] and got["lrs"] == ref["lrs"]
    assert got["losses"] == pytest.approx(ref["losses"], abs=LOSS_TOL)
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=NORM_RTOL)
    assert got["kl"] == pytest.approx(ref["kl"], abs=REWARD_TOL)  # differences of log-prob sums, as DPO's rewards
    assert got["num_tokens"] == ref["num_tokens"]


def test_settings_that_cannot_hold_at_tp2_are_refused(results):
    messages = refusal(results, "tp2", "online_refusals")
    for name, fix in (("use_transformers_continuous_batching", "leave it off"),
                      ("generation_batch_size", "raise per_device_train_batch_size or steps_per_generation"),
                      ("neftune_noise_alpha", "leave neftune_noise_alpha unset"),
                      ("precompute_ref_log_probs", "leave it off")):
        message = messages[name]
        assert message and name in message and fix in message and "\n" not in message, message
    for name in ("use_transformers_continuous_batching", "neftune_noise_alpha", "precompute_ref_log_probs"):
        assert "at tp=2" in messages[name], messages[name]


# The settings that change the loss or the batch arithmetic (docs/settings.md), each at tp=2 against
# one process. The Trainer's fp32 bounds, the loss's taken relative to its size as well: the sum of
# every DPO loss type is about 19 (ulp 1.9e-6), where a few ulps a step exceed LOSS_TOL absolute.
@pytest.mark.parametrize("run", [run for run in SETTINGS if run != "grpo_losses"])
def test_settings_train_like_one_process(results, run):
    import hf_trainer_worker

    assert SETTINGS == tuple(hf_trainer_worker.SETTINGS)
    got, ref = run_of(results, "tp2", run)
    assert got["steps"] == ref["steps"] and len(got["steps"]) in (2, 4) and got["lrs"] == ref["lrs"]
    assert got["losses"] == pytest.approx(ref["losses"], abs=LOSS_TOL, rel=NORM_RTOL)
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=NORM_RTOL)
    assert got["num_tokens"] == ref["num_tokens"] and got["input_tokens"] == ref["input_tokens"]


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "cispo", "sapo", "vespo", "luspo"])
def test_grpo_loss_types_train_like_one_process(results, loss):
    got, ref = run_of(results, "tp2", "grpo_losses")
    got, ref = got[loss], ref[loss]
    assert got["completions"] == ref["completions"] and got["steps"] == ref["steps"] == [1]
    assert got["rewards"] == pytest.approx(ref["rewards"], abs=REWARD_MEAN_TOL)
    assert got["losses"] == pytest.approx(ref["losses"], abs=LOSS_TOL)
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=NORM_RTOL)
    assert got["num_tokens"] == ref["num_tokens"]
