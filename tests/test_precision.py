"""Real TP (two gloo ranks) under autocast and with bf16 parameters, against the same model on
one process in the same precision.

Every case builds a tiny transformers model, keeps a copy as the one-process reference, and
runs one forward and backward of each under the same precision: bf16 autocast (families x
sequence parallelism x overlap, LoRA, the emulated ranks, compression on), fp16 autocast, and
bf16 parameters without autocast. One `run_ranks` launch runs every case (`harness.per_case`).

The bound (``_bound``): both runs round the same quantities to the low precision, at different
points (the parallel run rounds each rank's partial product, then its sum; the bias is added
after the reduction). With round-to-nearest, a rounding moves a value by a relative amount of at
most u (2**-8 bf16, 2**-11 fp16), whose rms is u/sqrt(3) if uniform (the probabilistic rounding
model, Higham & Mary 2019); independent roundings along one path add in quadrature, so a run
with N roundings on the path to an output is off the exact value by u sqrt(N/3) in relative
rms, and two runs differ by at most the sum: u (sqrt(N_a) + sqrt(N_b)) / sqrt(3). N is counted
in each run (`_Roundings`: every op that writes a low-precision tensor, over the whole forward,
or forward and backward for gradients), which over-counts any one path; the tiny models (norms
before every block, O(1) weights) do not amplify a relative error along the path.
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
import torch.distributed as dist
from harness import case, lm_batch, per_case, refusals, run_ranks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import taco_accel
from taco_accel import comm
from taco_accel.models.state import shard_specs
from taco_accel.models.tiny import tiny_model

ARCHS = ("qwen3", "gpt2", "llama")  # q/k norms and attention biases; Conv1D and tied; a replicated kv head
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # unit roundoff
COMPRESSED = taco_accel.TacoConfig()  # "on" with these settings: tiny tensors compress too
ATEN = torch.ops.aten
# ops that move or allocate without rounding
_EXACT = {ATEN.clone.default, ATEN.copy_.default, ATEN.cat.default, ATEN.stack.default, ATEN.detach.default,
          ATEN._unsafe_view.default, ATEN.empty_like.default, ATEN.zeros_like.default, ATEN.new_empty.default,
          ATEN.new_zeros.default, ATEN.empty.memory_format, ATEN.zeros.default, ATEN.fill_.Scalar,
          ATEN.masked_fill.Scalar, ATEN.index_select.default, ATEN.embedding.default, ATEN.gather.default,
          ATEN.slice.Tensor, ATEN.select.int, ATEN.narrow.default, ATEN.contiguous.default}


class _Roundings(TorchDispatchMode):
    """Count the ops that write a tensor of ``dtype`` (each a rounding to it), views and copies aside."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype, self.count = dtype, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and func not in _EXACT and any(
                isinstance(t, torch.Tensor) and t.dtype == self.dtype for t in tree_leaves(out)):
            self.count += 1
        return out


def _bound(dtype: torch.dtype, n_a: int, n_b: int) -> float:
    """Relative rms difference of two runs with n_a and n_b roundings (module docstring)."""
    return UNIT[dtype] * (math.sqrt(n_a) + math.sqrt(n_b)) / math.sqrt(3)


def _grads_rel_rms(model, ref, emulate: bool = False) -> float:
    """Relative rms difference of ``model``'s gradients (this rank's shards; trainable ones) from
    the one-process ``ref``'s, each reference gradient cut to the shard this rank holds."""
    rank, specs = (0, {}) if emulate else (model.taco.rank, shard_specs(model))
    diff_sq = ref_sq = 0.0
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        expected = ref.get_parameter(name).grad
        if name in specs:
            expected = specs[name].take(expected, rank)
        diff_sq += float((param.grad.double() - expected.double()).pow(2).sum())
        ref_sq += float(expected.double().pow(2).sum())
    return math.sqrt(diff_sq / ref_sq)


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def _step(model, ids, labels, autocast: torch.dtype | None, dtype: torch.dtype) -> dict:
    """One forward and backward; the logits, the loss and the roundings counted on the way."""
    count = _Roundings(dtype)
    with torch.autocast(ids.device.type, dtype=autocast, enabled=autocast is not None), count:
        out = model(ids, labels=labels)
    forward = count.count
    with count:
        out.loss.backward()
    logits = None if out.logits is None else out.logits.detach()  # logits="none": the fused head and loss
    return {"logits": logits, "loss": out.loss.detach(), "n_fwd": forward, "n_all": count.count}


def _precision_case(arch: str, *, sp: bool = False, overlap: bool = True, autocast=torch.bfloat16,
                    params=torch.float32, lora: bool = False, emulate: bool = False, compression=None,
                    logits: str = "full") -> dict:
    ref = tiny_model(arch).to(params)
    kwargs = dict(tp=2, emulate=True) if emulate else {}
    model = taco_accel.parallelize(copy.deepcopy(ref), compression=compression, sequence_parallel=sp, logits=logits,
                                   **kwargs)
    if not emulate:
        model.taco.overlap.enabled = overlap
    if lora:
        from peft import LoraConfig, get_peft_model

        config = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, lora_dropout=0.0)
        torch.manual_seed(7)
        ref = get_peft_model(ref, LoraConfig(**config))
        torch.manual_seed(7)  # the same draws on every rank and in the reference
        model = taco_accel.get_peft_model(model, LoraConfig(**config))
    ids, labels = lm_batch(ref.config.vocab_size)
    dtype = autocast or params
    comm.pop_comm_stats()
    got, want = _step(model, ids, labels, autocast, dtype), _step(ref, ids, labels, autocast, dtype)
    stats = comm.pop_comm_stats()
    grad_dtypes = {param.grad.dtype == param.dtype for param in model.parameters() if param.requires_grad}
    return {
        "logits": None if got["logits"] is None else _rel_rms(got["logits"], want["logits"]),
        "loss": abs(got["loss"].item() - want["loss"].item()),
        "loss_value": want["loss"].item(), "grads": _grads_rel_rms(model, ref, emulate),
        "logits_bound": _bound(dtype, got["n_fwd"], want["n_fwd"]), "grads_bound": _bound(dtype, got["n_all"], want["n_all"]),
        "logits_dtype": (getattr(got["logits"], "dtype", None), want["logits"].dtype),
        "grad_dtypes_match": grad_dtypes == {True},
        "compressed_calls": sum(s.compressed_calls for s in stats.values()),
        "rounds": (got["n_fwd"], want["n_fwd"], got["n_all"], want["n_all"]),
    }


# every family with overlap (the fused autograd functions); the unfused path (built-in ops, whose
# backward autograd casts itself) on one family
CASES = {}
for _sp in (False, True):
    _name = "sp" if _sp else "tp"
    for _arch in ARCHS:
        CASES[_arch, _name, "overlap"] = dict(arch=_arch, sp=_sp)
    CASES["qwen3", _name, "unfused"] = dict(arch="qwen3", sp=_sp, overlap=False)
    CASES["qwen3", _name, "bf16 params"] = dict(arch="qwen3", sp=_sp, autocast=None, params=torch.bfloat16)
    CASES["qwen3", _name, "fp16 autocast"] = dict(arch="qwen3", sp=_sp, autocast=torch.float16)
    CASES["qwen3", _name, "lora"] = dict(arch="qwen3", sp=_sp, lora=True)
    CASES["qwen3", _name, "compressed"] = dict(arch="qwen3", sp=_sp, compression=COMPRESSED)
CASES["gpt2", "tp", "lora"] = dict(arch="gpt2", lora=True)  # Conv1D under LoRA: the row layer's bias
CASES["llama", "tp", "emulated"] = dict(arch="llama", emulate=True)  # the emulated row layer's bias
# logits="none": the head and loss fused, in bf16 autocast (tp, sp, emulated) and with bf16 parameters
FUSED = {("qwen3", "tp", "fused"): dict(arch="qwen3", logits="none"),
         ("qwen3", "sp", "fused"): dict(arch="qwen3", sp=True, logits="none"),
         ("gpt2", "tp", "fused bf16 params"): dict(arch="gpt2", autocast=None, params=torch.bfloat16, logits="none"),
         ("llama", "tp", "fused emulated"): dict(arch="llama", emulate=True, logits="none")}
CASES.update(FUSED)


def _accelerator(mixed_precision: str, **kwargs):
    """A `taco_accel.Accelerator` at tp=2 in ``mixed_precision``, a fresh Accelerate state each (its
    mixed precision is fixed once per state; the process group stays)."""
    from accelerate import ParallelismConfig
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()
    kwargs.setdefault("parallelism_config", ParallelismConfig(tp_size=2))
    return taco_accel.Accelerator(mixed_precision=mixed_precision, compression=None, **kwargs)


def _own_loop(sp: bool, bf16_params: bool) -> dict:
    """A user's own loop: Accelerator(mixed_precision="bf16") (or bf16 parameters, "no"), one
    step's logits and gradients against the same model on one process in the same precision,
    then two more optimizer steps."""
    acc = _accelerator("no" if bf16_params else "bf16", sequence_parallel=sp)
    params, autocast = (torch.bfloat16, None) if bf16_params else (torch.float32, torch.bfloat16)
    ref = tiny_model("qwen3").to(params)
    model = copy.deepcopy(ref)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ids, labels = lm_batch(ref.config.vocab_size)
    count = _Roundings(torch.bfloat16)
    with count:
        out = model(ids, labels=labels)  # the prepared forward runs in the accelerator's autocast
        n_fwd = count.count
        acc.backward(out.loss)
    want = _step(ref, ids, labels, autocast, torch.bfloat16)
    grads = _grads_rel_rms(model, ref)
    losses = [out.loss.item()]
    for _ in range(2):
        opt.step()
        opt.zero_grad()
        loss = model(ids, labels=labels).loss
        acc.backward(loss)
        losses.append(loss.item())
    return {"logits": _rel_rms(out.logits, want["logits"]), "grads": grads,
            "logits_bound": _bound(torch.bfloat16, n_fwd, want["n_fwd"]),
            "grads_bound": _bound(torch.bfloat16, count.count, want["n_all"]),
            "logits_dtype": str(out.logits.dtype), "losses": losses,
            "where": (acc.device.type, dist.get_backend(acc.torch_device_mesh["tp"].get_group()),
                      next(model.parameters()).device.type)}


def _fp16_overflow_on_one_rank() -> dict:
    """fp16 autocast and loss scaling; rank 1's shard of one gradient overflows (set to inf after
    the backward, as a large fp16 product on that rank alone would make it): every rank skips the
    step and backs off the scale; the next step, without overflow, every rank takes."""
    acc = _accelerator("fp16")
    model = tiny_model("qwen3")
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ids, labels = lm_batch(model.config.vocab_size)
    shard = model.model.layers[0].mlp.gate_proj.weight  # column parallel: each rank its own rows
    out = {"scaler": type(acc.scaler).__name__, "scale0": acc.scaler.get_scale()}
    for step in range(2):
        before = shard.detach().clone()
        with acc.autocast():
            loss = model(ids, labels=labels).loss
        acc.backward(loss)
        if step == 0 and dist.get_rank() == 1:
            shard.grad[0, 0] = float("inf")
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        out[f"skipped{step}"] = bool(opt.step_was_skipped)
        out[f"moved{step}"] = bool(not torch.equal(before, shard.detach()))
        out[f"scale{step + 1}"] = acc.scaler.get_scale()
        out[f"loss{step}"] = loss.item()
    return out


def _refusals() -> dict:
    """What prepare refuses, on every rank, in one line: fp16 autocast over fp16 parameters; fp16
    with pipeline stages."""
    from taco_accel import ParallelDims

    return refusals({
        "half_params": lambda: _accelerator("fp16").prepare(tiny_model("qwen3").half()),
        "pipeline": lambda: _accelerator("fp16", parallelism_config=None, parallel_dims=ParallelDims(pp=2))
        .prepare_pipeline(tiny_model("qwen3"), micro_batches=2),
    })


def _pipeline_bf16() -> dict:
    """prepare_pipeline under mixed_precision="bf16" (pp=2, a stage per rank): the schedule runs
    in the accelerator's autocast (no autocast around ``runner.step``); the loss against the
    one-process model under the same autocast."""
    from taco_accel import ParallelDims

    acc = _accelerator("bf16", parallelism_config=None, parallel_dims=ParallelDims(pp=2))
    ref = tiny_model("qwen3")
    runner = acc.prepare_pipeline(copy.deepcopy(ref), micro_batches=2)
    ids = torch.randint(0, ref.config.vocab_size, (4, 8), generator=torch.Generator().manual_seed(2))
    count = _Roundings(torch.bfloat16)
    with count:
        loss = float(runner.step(ids, ids))
    dist.broadcast_object_list(box := [loss], src=1)  # the last stage's loss
    want = [_step(ref, i, i, torch.bfloat16, torch.bfloat16) for i in ids.chunk(2)]
    return {"loss": abs(box[0] - sum(w["loss"].item() for w in want) / 2), "loss_value": want[0]["loss"].item(),
            "rounds": count.count, "bound": _bound(torch.bfloat16, want[0]["n_fwd"], want[0]["n_fwd"])}


def _worker() -> dict:
    cases = {key: functools.partial(_precision_case, **kwargs) for key, kwargs in CASES.items()}
    cases["pipeline bf16"] = _pipeline_bf16
    for sp in (False, True):
        cases["loop", sp, "bf16 autocast"] = functools.partial(_own_loop, sp, False)
        cases["loop", sp, "bf16 params"] = functools.partial(_own_loop, sp, True)
    cases["fp16 overflow"] = _fp16_overflow_on_one_rank
    cases["refusals"] = _refusals
    return per_case(cases)


@pytest.fixture(scope="module")
def measured():
    return run_ranks(_worker, 2)


@pytest.mark.parametrize("key", [k for k in CASES if k[2] != "compressed" and k not in FUSED], ids=lambda k: "-".join(k))
def test_parallel_matches_one_process_in_the_same_precision(measured, key):
    for r in case(measured, key):
        assert r["logits_dtype"][0] == r["logits_dtype"][1] and r["grad_dtypes_match"], r
        # relative rms within the rounding bound of the module docstring (u (sqrt N_a + sqrt N_b) / sqrt 3)
        assert r["logits"] < r["logits_bound"], r
        assert r["grads"] < r["grads_bound"], r


@pytest.mark.parametrize("key", list(FUSED), ids=lambda k: "-".join(k))
def test_fused_head_and_loss_match_one_process_in_the_same_precision(measured, key):
    for r in case(measured, key):
        assert r["logits_dtype"][0] is None and r["grad_dtypes_match"], r  # no logits were computed
        # the loss, a mean over tokens of functions of the logits, within the logits' rounding
        # bound (module docstring); the gradients within theirs
        assert r["loss"] / r["loss_value"] < r["logits_bound"], r
        assert r["grads"] < r["grads_bound"], r


@pytest.mark.parametrize("sp", ["tp", "sp"])
def test_compressed_under_bf16_autocast_stays_close(measured, sp):
    for r in case(measured, ("qwen3", sp, "compressed")):
        assert r["compressed_calls"] > 0, r
        # FP8 on every TP message on top of bf16: the loss within the compressed sanity bound of
        # test_parallelize (0.5% at the first step; it is a mean over 14 tokens), the logits
        # within the codec's per-message bound (E4M3: 2**-4 relative at most) plus bf16's
        assert r["loss"] / r["loss_value"] < 5e-3, r
        assert r["logits"] < 2.0**-4 + r["logits_bound"], r


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("precision", ["bf16 autocast", "bf16 params"])
def test_own_loop_in_bf16_matches_one_process(measured, sp, precision):
    for r in case(measured, ("loop", sp, precision)):
        # Accelerate returns autocast outputs in fp32 (convert_outputs_to_fp32), as for a plain model
        assert r["logits_dtype"] == ("torch.bfloat16" if precision == "bf16 params" else "torch.float32"), r
        # the first step: relative rms within the rounding bound of the module docstring
        assert r["logits"] < r["logits_bound"] and r["grads"] < r["grads_bound"], r
        assert all(math.isfinite(x) for x in r["losses"]) and r["losses"][-1] < r["losses"][0], r  # it trains


def test_the_accelerator_keeps_the_ranks_on_the_cpu_when_told(measured):
    # conftest.py sets ACCELERATE_USE_CPU for the session: on a GPU box too, the Accelerator's device,
    # its mesh's backend and the prepared model are the CPU's (two ranks cannot share one GPU in NCCL)
    for r in case(measured, ("loop", False, "bf16 autocast")):
        assert r["where"] == ("cpu", "gloo", "cpu"), r


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(measured):
    ranks = case(measured, "fp16 overflow")
    for r in ranks:
        assert r["scaler"] == "MeshGradScaler", r
        assert r["skipped0"] and not r["moved0"], r  # rank 1's overflow: rank 0 skips too
        assert r["scale1"] == r["scale0"] / 2, r  # and backs off with it
        assert not r["skipped1"] and r["moved1"] and r["scale2"] == r["scale1"], r
    assert len({(r["scale1"], r["loss1"]) for r in ranks}) == 1  # the ranks still agree


def test_prepare_refuses_what_cannot_work_in_one_line(measured):
    for r in case(measured, "refusals"):
        assert "fp32 trainable parameters" in r["half_params"] and "\n" not in r["half_params"], r
        assert "pipeline stages" in r["pipeline"] and "\n" not in r["pipeline"], r


def test_pipeline_stages_run_in_the_accelerators_bf16(measured):
    for r in case(measured, "pipeline bf16"):
        assert r["rounds"] > 0, r  # this rank's stage computed in bf16
        # the loss, a mean over tokens of functions of the logits, within the logits' bound
        assert r["loss"] / r["loss_value"] < r["bound"], r
