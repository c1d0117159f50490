"""Every entry point x precision x layout trains as the same script does on one process (issue 49).

Entries: a user's own Accelerate loop, ``taco_trainer`` of transformers' Trainer, TRL's SFTTrainer,
DPOTrainer (a reference model passed in, built by TRL from the policy's path, a LoRA policy) and
GRPOTrainer (its completions made by a rollout function, the same rows in every layout), the
Finetuner and the recipes' pretraining Trainer. Precisions: fp32, bf16 autocast, bf16 parameters,
fp16 autocast (with the MeshGradScaler). Layouts: tp=2 and dp=2 x tp=2, in each a job of
tests/entry_matrix_worker.py that runs every cell of the layout, in the ``accelerate launch`` of
that mesh which tests/launches.py shares with the other modules (the sizes from the launch config,
as a user's script reads them); the one-process references run meanwhile in one interpreter, one
per (entry, precision), on the global batches both layouts share.

A cell another test already runs against one process is skipped here, naming that test (`COVERED`);
a cell an entry does not offer is a row asserting its one-line refusal (`REFUSED`). Every launched
cell, and taco_accel's entries on one process (tp=1), compute their loss through the head and loss of
`taco_accel.models.loss` (`PATHS`: the fused head and loss, or TRL's fused LM head's per-token
log-probabilities, each counted by `harness.loss_paths`); on one process in fp32 they train as the
plain classes do (`TP1`).

Bounds. fp32: the project's fp32 tolerances of these trainings (tests/test_hf_trainer.py: the runs
differ in the order of fp32 sums). Low precision: tests/test_precision.py's bound, two runs with N_a
and N_b roundings on the path differ in relative rms by at most u (sqrt N_a + sqrt N_b) / sqrt 3
(u = 2**-8 bf16, 2**-11 fp16), with N counted by the reference on one forward (losses) and one
forward and backward (gradient norms) of each entry's model in that precision; fp16 against the
fp32 reference counts the roundings of one side. The losses of later steps keep the bound: the
updates are equal where gradients are not rounding noise, and where they are the loss barely feels
them (tests/test_accelerator.py); bf16 parameters add one rounding per parameter tensor there (the
optimizer writes each weight in bf16). DPO: step 1 gives ln 2 (the policy is its reference, both
computed alike), and the policy's log-probability sums (same-sign sums of per-token functions of the
logits, like the loss) keep the loss bound; its rewards and later losses are differences of such
sums, with no relative bound in low precision. GRPO: its rewards are functions of the completions'
text (equal); its policy loss sums advantages of both signs (no relative bound), while the mean
entropy of the completion tokens (a same-sign mean of per-token functions of the logits) keeps the
loss bound, and the first gradient norm the norm bound.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import launches
import pytest
import torch
from harness import finish_command, start_command

from test_hf_trainer import LOSS_TOL, NORM_RTOL, REWARD_MEAN_TOL
from test_precision import _bound

WORKER = Path(__file__).with_name("entry_matrix_worker.py")
ENTRIES = ("loop", "trainer", "sft", "dpo", "dpo_path", "dpo_lora", "grpo", "finetuner", "recipes")
PRECISIONS = ("fp32", "bf16", "bf16_params", "fp16")
LAYOUTS = ("tp2", "dp2_tp2")  # meshes of tests/launches.py
MODEL = {"finetuner": "finetuner", "recipes": "recipes"}  # the model whose roundings bound an entry (else "tiny")
REFERENCE_PRECISION = {"fp16": "fp32"}  # one CPU process runs fp16 as fp32 (Accelerate's rule)

HF, ACC = "tests/test_hf_trainer.py", "tests/test_accelerator.py"
COVERED = {  # (entry, precision, layout): the test that runs this cell against one process already
    ("loop", "fp32", "tp2"): f"{ACC}::test_compression_off_equals_one_process",
    ("loop", "fp32", "dp2_tp2"): f"{ACC}::test_compression_off_equals_one_process",
    ("loop", "bf16", "tp2"): f"{ACC}::test_bf16_mixed_precision_trains_like_one_process",
    ("loop", "bf16_params", "tp2"): "tests/test_precision.py::test_own_loop_in_bf16_matches_one_process",
    ("trainer", "fp32", "tp2"): f"{HF}::test_trainer_trains_like_one_process",
    ("trainer", "fp32", "dp2_tp2"): f"{HF}::test_trainer_trains_like_one_process",
    ("sft", "fp32", "tp2"): f"{HF}::test_sft_trainer_trains_like_one_process",
    ("sft", "fp32", "dp2_tp2"): f"{HF}::test_sft_trainer_trains_like_one_process",
    ("dpo", "fp32", "tp2"): f"{HF}::test_dpo_trainer_trains_like_one_process",
    ("dpo", "fp32", "dp2_tp2"): f"{HF}::test_dpo_trainer_trains_like_one_process",
    ("dpo_path", "fp32", "tp2"): f"{HF}::test_dpo_trainer_trains_like_one_process",
    ("dpo_lora", "fp32", "tp2"): f"{HF}::test_dpo_trainer_trains_like_one_process",
    ("grpo", "fp32", "tp2"): f"{HF}::test_grpo_and_rloo_trainers_train_like_one_process",
    ("finetuner", "fp32", "tp2"): "tests/test_finetune.py::test_tp2_and_dp2_equal_one_process",
    ("recipes", "fp32", "tp2"): "tests/test_pipeline.py::test_tensor_parallel_matches_single_process",
}


def _finetuner_fp16():
    from taco_accel.training.finetune import FinetuneConfig

    FinetuneConfig(data="records.jsonl", mixed_precision="fp16")


def _recipes_fp16():
    from taco_accel.training import TrainConfig

    TrainConfig(mixed_precision="fp16")


def _recipes_bf16_params():
    from taco_accel.training.cli import build_parser

    build_parser("qwen2", "the recipe").parse_args(["--dtype", "bfloat16"])


REFUSED = {  # (entry, precision): the call a user makes, what it raises, a fragment of its one-line message
    ("finetuner", "fp16"): (_finetuner_fp16, ValueError, "mixed_precision='fp16': use one of ('no', 'bf16')"),
    ("recipes", "fp16"): (_recipes_fp16, ValueError, "mixed_precision='fp16': use one of ('no', 'bf16')"),
    # pretraining keeps fp32 master weights: its command line has no --dtype (argparse: status 2)
    ("recipes", "bf16_params"): (_recipes_bf16_params, SystemExit, "2"),
}
CELLS = [(entry, precision, layout) for layout in LAYOUTS for entry in ENTRIES for precision in PRECISIONS]
# the chunked function each entry's training loss takes: the fused head and loss (the loop asks for
# logits="none"; the Trainer's compute_loss and the recipes' schedule use it), or the per-token
# log-probabilities of TRL's fused LM head (SFT, DPO, GRPO), vocab-parallel
PATHS = {"loop": "fused", "trainer": "fused", "sft": "log_probs", "dpo": "log_probs", "dpo_path": "log_probs",
         "dpo_lora": "log_probs", "grpo": "log_probs", "finetuner": "fused", "recipes": "fused"}
TP1 = ("loop", "trainer", "sft", "dpo")  # taco_accel's classes on one process too, in fp32
OWN = ("finetuner", "recipes")  # taco_accel's own classes: their references run them at tp=1


def _run_here(entry: str, precision: str, layout: str) -> bool:
    return (entry, precision) not in REFUSED and (entry, precision, layout) not in COVERED


def _launched(layout: str) -> list[str]:
    return [f"{e}/{p}" for e, p, l in CELLS if l == layout and _run_here(e, p, l)]


def _referenced() -> list[str]:
    """The reference cells, in ENTRIES order, then taco_accel's on one process (they, the Finetuner and
    the recipes start a process group: last)."""
    needed = {(e, REFERENCE_PRECISION.get(p, p)) for e, p, l in CELLS if _run_here(e, p, l)} | {(e, "fp32") for e in TP1}
    plain = [f"{e}/{p}" for e in ENTRIES for p in PRECISIONS if (e, p) in needed and e not in OWN]
    return plain + [f"{e}/fp32/tp1" for e in TP1] + [f"{e}/{p}" for e in OWN for p in PRECISIONS if (e, p) in needed]


for _layout in LAYOUTS:  # each a job of the launch the modules on that mesh share (tests/launches.py)
    launches.register(f"entry_matrix_{_layout}", _layout, "entry_matrix_worker",
                      lambda folder, layout=_layout: ["--dir", str(folder), "--cells", ",".join(_launched(layout))])


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, shared_launches) -> dict:
    """``{layout: {cell: figures}, "reference": {cell: figures, "roundings": ...}}``."""
    tmp = tmp_path_factory.mktemp("entry_matrix")
    reference = start_command(
        [sys.executable, str(WORKER), "--reference", "--out", str(tmp / "reference.json"), "--dir",
         str(tmp / "reference"), "--cells", ",".join(_referenced())], env=launches.trainer_env(), cwd=tmp)
    out = {}
    for layout in LAYOUTS:
        out[layout] = shared_launches(layout)[f"entry_matrix_{layout}"]
        assert "launch_error" not in out[layout], out[layout]["launch_error"]
    log = finish_command(reference)
    assert reference.returncode == 0, log[-6000:]
    out["reference"] = json.loads((tmp / "reference.json").read_text())
    return out


def _figures(matrix: dict, entry: str, precision: str, layout: str) -> tuple[dict, dict, dict]:
    """The launched cell's figures, its reference's, and the reference's rounding counts of its model."""
    got = matrix[layout][f"{entry}/{precision}"]
    ref = matrix["reference"][f"{entry}/{REFERENCE_PRECISION.get(precision, precision)}"]
    assert "error" not in got, got["error"]
    assert "error" not in ref, ref["error"]
    return got, ref, matrix["reference"]["roundings"][MODEL.get(entry, "tiny")]


def _relative(got: list[float], ref: list[float]) -> list[float]:
    return [abs(a - b) / abs(b) for a, b in zip(got, ref)]


def _low_precision_bounds(precision: str, counts: dict) -> tuple[list[float], float]:
    """Relative bounds of the losses of each step and of the first gradient norm (module docstring)."""
    fwd, both = counts[precision]
    if precision == "fp16":  # against the fp32 reference: roundings on one side
        return [_bound(torch.float16, fwd, 0)] * 2, _bound(torch.float16, both, 0)
    later = fwd + counts["params"] if precision == "bf16_params" else fwd
    return [_bound(torch.bfloat16, fwd, fwd), _bound(torch.bfloat16, later, later)], \
        _bound(torch.bfloat16, both, both)


@pytest.mark.parametrize("entry,precision,layout", CELLS, ids=["-".join(c) for c in CELLS])
def test_every_cell_trains_like_one_process(request, entry, precision, layout):
    if (entry, precision) in REFUSED:
        call, error, fragment = REFUSED[entry, precision]
        with pytest.raises(error) as refused:
            call()
        assert fragment in str(refused.value) and "\n" not in str(refused.value)
        return
    if (entry, precision, layout) in COVERED:
        pytest.skip(f"this cell is {COVERED[entry, precision, layout]}")
    got, ref, counts = _figures(request.getfixturevalue("matrix"), entry, precision, layout)
    assert len(got["losses"]) == len(ref["losses"]) == 2, (got, ref)
    for count in ("steps", "lrs", "input_tokens", "num_tokens"):  # the Trainer's counts: exact in every precision
        assert got.get(count) == ref.get(count), (count, got, ref)
    dpo, grpo = entry.startswith("dpo"), entry == "grpo"
    if grpo:  # the same completions, so the same rewards (test_hf_trainer.REWARD_MEAN_TOL: their logged mean)
        assert got["rewards"] == pytest.approx(ref["rewards"], abs=REWARD_MEAN_TOL), (got, ref)
    if dpo:  # the policy is its own reference at step 1: loss ln 2, in every precision (fp32 rounding of it)
        assert got["losses"][0] == pytest.approx(math.log(2), abs=LOSS_TOL), got
    if precision == "fp32":  # the runs differ in the order of fp32 sums (test_hf_trainer.py's bounds)
        assert got["losses"] == pytest.approx(ref["losses"], abs=LOSS_TOL), (got, ref)
        assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=NORM_RTOL), (got, ref)
        if grpo:
            assert got["entropy"] == pytest.approx(ref["entropy"], abs=LOSS_TOL), (got, ref)
        return
    assert got["low_precision_ops"] > 0, got  # it computed in its precision, not silently in fp32
    if precision == "fp16" and "scaler" in got:  # every entry that offers fp16 scales the loss over the mesh
        assert got["scaler"] == "MeshGradScaler", got
    losses, first_norm = _low_precision_bounds(precision, counts)
    if dpo:
        for step, bound in enumerate(losses):
            assert max(_relative(got["logps"][step], ref["logps"][step])) < bound, (step, bound, got, ref)
        return
    if grpo:  # the policy loss is a signed sum (advantages of both signs): its entropy keeps the loss bound
        assert all(d < b for d, b in zip(_relative(got["entropy"], ref["entropy"]), losses)), (losses, got, ref)
        assert _relative(got["grad_norms"][:1], ref["grad_norms"][:1])[0] < first_norm, (first_norm, got, ref)
        return
    assert all(d < b for d, b in zip(_relative(got["losses"], ref["losses"]), losses)), (losses, got, ref)
    assert _relative(got["grad_norms"][:1], ref["grad_norms"][:1])[0] < first_norm, (first_norm, got, ref)


def test_covered_cells_name_tests_that_exist():
    import importlib

    for where in set(COVERED.values()):
        path, name = where.split("::")
        assert hasattr(importlib.import_module(Path(path).stem), name), where


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_launched_cell_takes_the_head_and_loss_of_taco_accel(matrix, layout):
    """tp=2 and dp=2 x tp=2: each entry's loss through its chunked function (`PATHS`), in every precision."""
    cells = [(e, p) for e, p, l in CELLS if l == layout and _run_here(e, p, l)]
    assert cells
    for entry, precision in cells:
        got = matrix[layout][f"{entry}/{precision}"]
        assert "error" not in got, got["error"]
        assert got["loss_paths"][PATHS[entry]] > 0, (entry, precision, got["loss_paths"])


@pytest.mark.parametrize("entry", TP1 + OWN)
def test_one_process_trains_through_the_head_and_loss_as_the_plain_classes(matrix, entry):
    """tp=1 (no tensor parallelism): taco_accel's classes still compute the loss through the head and
    loss of `taco_accel.models.loss`, and train as the plain classes on the same batches (fp32:
    tests/test_hf_trainer.py's bounds). The Finetuner's and the recipes' references are theirs."""
    ref = matrix["reference"]
    got = ref[f"{entry}/fp32/tp1"] if entry in TP1 else ref[f"{entry}/fp32"]
    assert "error" not in got, got["error"]
    assert got["loss_paths"][PATHS[entry]] > 0, got["loss_paths"]
    if entry in TP1:
        plain = ref[f"{entry}/fp32"]
        assert plain["loss_paths"] == {"fused": 0, "log_probs": 0, "logits": 0}, plain["loss_paths"]
        assert got["losses"] == pytest.approx(plain["losses"], abs=LOSS_TOL), (got, plain)
        assert got["grad_norms"] == pytest.approx(plain["grad_norms"], rel=NORM_RTOL), (got, plain)


# -- TRL's fused LM head: found under Accelerate's wrappers and torch.compile ----------------------

def test_trls_fused_head_is_found_under_accelerates_mixed_precision_wrappers():
    """What TRL's DPOTrainer does to its reference model inside __init__: Accelerate prepares it under
    bf16, and its forward becomes convert_outputs_to_fp32 around autocast around TRL's fused forward."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from trl.trainer.utils import add_fused_lm_head

    from taco_accel.models.tiny import tiny_model
    from taco_accel.upstream import trl as upstream_trl

    model = tiny_model("qwen2")
    add_fused_lm_head(model)
    AcceleratorState._reset_state(True)  # a state an earlier test of this process left would refuse bf16
    GradientState._reset_state()
    try:
        Accelerator(mixed_precision="bf16", cpu=True).prepare_model(model, evaluation_mode=True)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    forward = model.__dict__["forward"]
    assert "fused_lm_head" not in forward.__code__.co_varnames  # the outer wrapper's own signature hides it
    assert upstream_trl.has_fused_head(forward)


def test_trls_fused_head_is_taken_over_inside_torch_compile():
    """A model compiled whole before ``prepare`` (a user's own ``torch.compile``; taco_accel's doors
    compile per decoder block and leave such a model as it is) is an OptimizedModule around the
    model TRL patched: the head and loss are installed on the model inside (its forward is what the
    compiled module calls), with TRL's settings."""
    from trl.trainer.utils import add_fused_lm_head

    from taco_accel.models.loss import install_head
    from taco_accel.models.tiny import tiny_model

    model = tiny_model("qwen2")
    add_fused_lm_head(model, temperature=0.5)
    install_head(torch.compile(model))  # compiles nothing until called
    assert model.taco_head.trl.temperature == 0.5 and model.__dict__["forward"].__func__.taco_head_forward
