"""What user code may rely on, on dp=2 x tp=2 (4 gloo ranks) against one process:

- transformers' outputs: ``outputs.logits`` has the full vocabulary with or without labels, in
  training and evaluation, with and without grad; a loss computed from it trains right;
  ``logits="local"`` (opt-in) returns this rank's slice; a pipeline's custom ``loss_fn`` sees
  full logits; emulated TP returns full logits in both modes.
- every backward is seen: losses from the logits, from hidden states, several backwards per
  step, ``loss.backward()`` instead of ``accelerator.backward``, gradient accumulation: the
  data-parallel replicas stay bit-identical and the weights equal one process's; a backward
  between clipping and the step raises.
- Accelerate's conventions: ``num_processes`` / ``process_index`` are the data-parallel ones and
  a prepared scheduler steps ``num_processes`` times per optimizer step; a schedule that ends
  long before the run is warned about; an optimizer made before its model was prepared (and
  not passed with it) is refused; ``prepare_model(..., evaluation_mode=True)`` lays the
  model out without data-parallel machinery. (The sizes read from a ``ParallelismConfig``, by
  Accelerate's rules: tests/test_accelerator_sizes.py, in one process.)

One `run_ranks` launch runs every case; each case returns its figures or its error, and each
test asserts on its own case.
"""

from __future__ import annotations

import copy
import logging
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_ranks

import taco_accel
from taco_accel.models.tiny import tiny_model

ARCH, VOCAB = "qwen2", 128


def _batch(seed: int, rows: int = 2, seq: int = 8) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))


def _accelerator(**kwargs):
    """dp=2 x tp=2 (DDP replicas) unless other sizes are given; taco_accel's own sizes: Accelerate
    1.15's ParallelismConfig refuses tp with replicated dp (test_accelerator_sizes checks that route)."""
    if "parallelism_config" not in kwargs:
        kwargs["parallel_dims"] = taco_accel.ParallelDims(dp=2, tp=2)
    return taco_accel.Accelerator(compression=None, **kwargs)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


# -- outputs ------------------------------------------------------------------------------------

def _outputs() -> dict:
    acc = _accelerator()
    ref = tiny_model(ARCH)
    model = acc.prepare(copy.deepcopy(ref))
    ids = _batch(1)
    out = {}
    for mode in ("train", "eval"):
        model.train(mode == "train"), ref.train(mode == "train")
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                for labels in (True, False):
                    kw = {"labels": ids} if labels else {}
                    got, expected = model(input_ids=ids, **kw), ref(input_ids=ids, **kw)
                    key = f"{mode}/{'grad' if grad else 'no_grad'}/{'labels' if labels else 'no_labels'}"
                    out[key] = (tuple(got.logits.shape), _diff(got.logits, expected.logits))
    acc.unwrap_model(model).taco.logits = "local"
    with torch.no_grad():
        out["local/labels"] = model(input_ids=ids, labels=ids).logits.shape[-1]
        out["local/no_labels"] = model(input_ids=ids).logits.shape[-1]
    return out


def _pipeline_loss_fn() -> dict:
    """prepare_pipeline (one stage: pp=1) with a custom loss_fn of the logits and labels."""
    acc = _accelerator()
    ref = tiny_model(ARCH)
    seen = []

    def loss_fn(logits, labels):
        seen.append(logits.shape[-1])
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())

    runner = acc.prepare_pipeline(copy.deepcopy(ref), micro_batches=2, loss_fn=loss_fn)
    ids, target = _batch(2 + acc.process_index, rows=4), _batch(9 + acc.process_index, rows=4)
    loss = runner.step(ids, target)
    expected = sum(loss_fn(ref(input_ids=i).logits, t) for i, t in zip(ids.chunk(2), target.chunk(2))) / 2
    return {"vocab_seen": sorted(set(seen[:2])), "loss": abs(float(loss) - float(expected))}


# -- every backward ----------------------------------------------------------------------------

def _logits_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A custom next-token loss computed from the full logits (distillation-like users do this)."""
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())


def _losses(model, ids: torch.Tensor, kind: str) -> list[torch.Tensor]:
    """The loss(es) of one step on ``ids`` (a list: one backward each)."""
    if kind == "logits":  # labels given: the model's loss exists, the user trains on its own
        return [_logits_loss(model(input_ids=ids, labels=ids).logits, ids)]
    if kind == "hidden":
        return [model(input_ids=ids, output_hidden_states=True).hidden_states[-1].pow(2).mean()]
    return [model(input_ids=half, labels=half).loss / 2 for half in ids.chunk(2)]  # two backwards


def _backward_paths() -> dict:
    """Three SGD steps, each through another path (the first clipped: reduced at the clip; the
    others at the step), then two micro-batches accumulated."""
    acc = _accelerator()
    ref = tiny_model(ARCH)
    initial = copy.deepcopy(ref.state_dict())
    model = copy.deepcopy(ref)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = acc.prepare(model, opt)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    dp, replica = acc.num_processes, acc.process_index
    for step, kind in enumerate(("logits", "hidden", "two_backwards")):
        ids = _batch(10 * step + replica, rows=2)
        everyone = acc.gather(ids).chunk(dp)  # the replicas' batches, in replica order
        for i, loss in enumerate(_losses(model, ids, kind)):
            acc.backward(loss) if i == 0 else loss.backward()  # loss.backward() works too
        if kind == "logits":
            acc.clip_grad_norm_(model.parameters(), 1e9)
        opt.step()
        opt.zero_grad()
        for batch in everyone:  # one process: the mean of the replicas' losses
            for loss in _losses(ref, batch, kind):
                (loss / dp).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    acc.gradient_accumulation_steps = 2  # accumulate: the reduction once, at the step
    for micro in range(2):
        ids = _batch(100 + 10 * micro + replica, rows=2)
        everyone = acc.gather(ids).chunk(dp)
        with acc.accumulate(model):
            acc.backward(_logits_loss(model(input_ids=ids).logits, ids))  # divided by the 2 steps
            opt.step()
            opt.zero_grad()
        for batch in everyone:
            (_logits_loss(ref(input_ids=batch).logits, batch) / dp / 2).backward()
    ref_opt.step()
    full, expected = acc.get_state_dict(model), ref.state_dict()
    sums = torch.stack([full[k].double().sum() for k in sorted(full)])
    replicas = [torch.zeros_like(sums) for _ in range(dist.get_world_size())]
    dist.all_gather(replicas, sums)
    return {"weights": max(_diff(full[k], expected[k]) for k in expected),
            "replicas_differ": max(_diff(r, replicas[0]) for r in replicas),
            "moved": max(_diff(full[k], initial[k]) for k in expected)}


def _backward_after_clip() -> dict:
    acc = _accelerator()
    model = tiny_model(ARCH)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    ids = _batch(3)
    acc.backward(model(input_ids=ids, labels=ids).loss)
    acc.clip_grad_norm_(model.parameters(), 1.0)
    try:
        acc.backward(model(input_ids=ids, labels=ids).loss)
        raised = None
    except RuntimeError as e:
        raised = str(e)
    opt.step()
    opt.zero_grad()
    acc.backward(model(input_ids=ids, labels=ids).loss)  # a new step: allowed again
    opt.step()
    return {"raised": raised}


# -- Accelerate's conventions -------------------------------------------------------------------

def _conventions() -> dict:
    from transformers import get_scheduler

    acc = _accelerator()
    model = tiny_model(ARCH)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    # sized the Accelerate-with-TP way (num_processes // tp): half as long as the run
    scheduler = get_scheduler("linear", opt, num_warmup_steps=0, num_training_steps=6 * acc.num_processes // 2)
    model, opt, scheduler = acc.prepare(model, opt, scheduler)
    warnings = _Collect()
    logging.getLogger("taco_accel").addHandler(warnings)
    counts = []
    for step in range(6):
        ids = _batch(40 + step)
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        scheduler.step()
        opt.zero_grad()
        counts.append(scheduler.scheduler.last_epoch)
    try:  # refused before any collective, on every rank
        acc.clip_grad_norm_(torch.nn.Linear(2, 2).parameters(), 1.0)
        stray = None
    except ValueError as e:
        stray = str(e)
    early = tiny_model(ARCH)
    early_opt = torch.optim.SGD(early.parameters(), lr=1.0)  # holds the full weights prepare() replaces
    acc.prepare(early)
    try:  # refused before any collective, on every rank
        acc.prepare(early_opt)
        stale = None
    except ValueError as e:
        stale = str(e)
    shares = {}
    for padded in (False, True):  # 5 prompts over the replicas (padded: each share as long)
        with acc.split_between_processes([f"prompt {i}" for i in range(5)], apply_padding=padded) as share:
            shares[padded] = share
    with acc.split_between_processes(torch.arange(5), apply_padding=True) as share:  # pads across every process
        shares["tensor"] = share.tolist()
    pc = acc.parallelism_config
    return {"num_processes": acc.num_processes, "process_index": acc.process_index, "world": acc.state.num_processes,
            "world_size": acc.world_size, "described": [pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size, pc.total_size],
            "shares": shares, "dp_rank": acc.data_parallel_rank, "scheduler_steps": counts,
            "warnings": [m for m in warnings.messages if "schedule" in m], "stray_clip": stray, "stale": stale}


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _evaluation_mode() -> dict:
    """FSDP2 over dp: a model prepared for training is sharded over dp, one for evaluation not."""
    from accelerate import ParallelismConfig

    acc = _accelerator(parallelism_config=ParallelismConfig(tp_size=2, dp_shard_size=2))
    ref = tiny_model(ARCH)
    evaluated = acc.prepare_model(copy.deepcopy(ref), evaluation_mode=True)
    trained = acc.prepare_model(copy.deepcopy(ref))
    ids = _batch(5)
    with torch.no_grad():
        logits = evaluated(input_ids=ids).logits
    dtensor = lambda m: any(hasattr(p, "to_local") for p in m.parameters())  # noqa: E731
    return {"eval_sharded_over_dp": dtensor(evaluated), "train_sharded_over_dp": dtensor(trained),
            "eval_tp": acc.unwrap_model(evaluated).taco.tp, "logits": _diff(logits, ref(input_ids=ids).logits)}


CASES = {
    "outputs": _outputs, "pipeline_loss_fn": _pipeline_loss_fn, "backward_paths": _backward_paths,
    "backward_after_clip": _backward_after_clip, "conventions": _conventions,
    "evaluation_mode": _evaluation_mode,
}


def _worker() -> dict:
    taco_accel.Accelerator(compression=None)  # the process group and Accelerate's state, as a script's first line
    out = {}
    for name, case in CASES.items():
        try:
            out[name] = case()
        except Exception:  # noqa: BLE001 - each test reads its own case
            out[name] = {"error": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def measured():
    return run_ranks(_worker, 4)


def _case(measured, name: str) -> list[dict]:
    for result in measured:
        assert "error" not in result[name], result[name]["error"]
    return [result[name] for result in measured]


def test_logits_have_the_full_vocabulary_everywhere_a_user_sees_them(measured):
    for r in _case(measured, "outputs"):
        for key, value in r.items():
            if key.startswith("local/"):
                continue
            shape, diff = value
            assert shape == (2, 8, VOCAB), (key, shape)
            assert diff < 1e-5, (key, diff)  # fp32 rounding of the TP reductions
        assert r["local/labels"] == VOCAB // 2 and r["local/no_labels"] == VOCAB  # the opt-in mode


def test_a_pipelines_custom_loss_sees_full_logits(measured):
    for r in _case(measured, "pipeline_loss_fn"):
        assert r["vocab_seen"] == [VOCAB], r
        assert r["loss"] < 1e-5, r  # the replica's own batch, fp32 rounding


def test_every_backward_is_reduced_over_the_replicas(measured):
    for r in _case(measured, "backward_paths"):
        assert r["replicas_differ"] == 0.0, r  # one all-reduce gives every replica the same bits
        # SGD (linear in the gradients): fp32 rounding of the TP and dp reductions, 5 steps
        assert r["weights"] < 1e-5, r
        assert r["moved"] > 1e-3, r  # the steps did train


def test_a_backward_between_clipping_and_the_step_raises(measured):
    for r in _case(measured, "backward_after_clip"):
        assert r["raised"] is not None and "clip_grad_norm_ after the last backward" in r["raised"], r


def test_num_processes_is_the_data_parallel_view(measured):
    results = _case(measured, "conventions")
    for rank, r in enumerate(results):
        assert (r["num_processes"], r["world"], r["world_size"]) == (2, 4, 4), r
        assert r["process_index"] == r["dp_rank"] == rank // 2, r  # tp innermost: ranks 0, 1 are replica 0
        assert r["described"] == [2, 1, 1, 2], r  # parallelism_config: the replicas (total_size = num_processes)
        # split over the replicas: the tp ranks of a replica get the same prompts
        assert r["shares"][False] == [["prompt 0", "prompt 1", "prompt 2"], ["prompt 3", "prompt 4"]][rank // 2], r
        assert r["shares"][True] == [["prompt 0", "prompt 1", "prompt 2"], ["prompt 3", "prompt 4", "prompt 4"]][rank // 2]
        assert r["shares"]["tensor"] == [[0, 1, 2], [3, 4, 4]][rank // 2], r
        assert r["scheduler_steps"] == [2, 4, 6, 8, 10, 12], r  # num_processes scheduler steps per optimizer step
    assert len(results[0]["warnings"]) == 1 and "num_processes // tp_size" in results[0]["warnings"][0], results[0]
    assert all(r["warnings"] == [] for r in results[1:])  # once, on the main process


def test_clipping_the_parameters_of_a_model_not_prepared_here_raises(measured):
    for r in _case(measured, "conventions"):
        assert "2 parameter(s) of no model prepared by this accelerator" in (r["stray_clip"] or ""), r


def test_an_optimizer_made_before_its_model_was_prepared_alone_raises(measured):
    for r in _case(measured, "conventions"):
        assert "that prepare() replaced by their tensor-parallel shards" in (r["stale"] or ""), r


def test_evaluation_mode_lays_out_without_data_parallelism(measured):
    for r in _case(measured, "evaluation_mode"):
        assert r["train_sharded_over_dp"] and not r["eval_sharded_over_dp"], r
        assert r["eval_tp"] == 2 and r["logits"] < 1e-5, r


def test_emulated_tp_returns_full_logits_in_both_modes():
    """One process, no torch.distributed: the emulation has no local slice to return."""
    ref = tiny_model(ARCH)
    ids = _batch(6)
    for mode in ("full", "local"):
        model = taco_accel.parallelize(copy.deepcopy(ref), tp=2, compression=None, emulate=True, logits=mode)
        out = model(input_ids=ids, labels=ids)
        assert out.logits.shape == (2, 8, VOCAB)
        assert _diff(out.logits, ref(input_ids=ids).logits) < 1e-5


def test_logits_mode_is_checked():
    with pytest.raises(ValueError, match="logits='shard'"):
        taco_accel.parallelize(tiny_model(ARCH), logits="shard")
    with pytest.raises(TypeError, match="must be a str"):
        taco_accel.parallelize(tiny_model(ARCH), logits=True)


def test_a_loss_function_set_on_the_model_still_computes_its_loss_at_tp_1():
    """``model.loss_function = fn`` before `parallelize`: the parallel loss hands tp=1 to ``fn``
    (transformers' default only where none was set)."""
    model = tiny_model(ARCH)
    model.loss_function = lambda logits, labels, vocab_size, **kwargs: logits.float().sum() * 0 + 3.0
    model = taco_accel.parallelize(model, tp=1, compression=None, emulate=True)
    ids = _batch(7)
    assert model(input_ids=ids, labels=ids).loss.item() == 3.0
