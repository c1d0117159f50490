"""Tensor parallelism on a GPU: bf16 weights, the fused Triton codec, two gloo ranks on one device.

Skipped without CUDA. NCCL refuses two ranks on one GPU, gloo does not, so this runs on the
one-GPU box too; it checks the CUDA path of the TP layers and codec, not NCCL speed.
"""

from __future__ import annotations

import copy

import pytest
import torch
from harness import run_ranks

import taco_accel
from taco_accel.models.tiny import tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _worker() -> dict:
    torch.cuda.set_device(0)
    out = {}
    for arch in ("qwen3", "gpt2"):
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
        ref = tiny_model(arch).cuda().to(torch.bfloat16)
        plain = taco_accel.parallelize(copy.deepcopy(ref), compression=None, sequence_parallel=True)
        packed = taco_accel.parallelize(
            copy.deepcopy(ref), compression=taco_accel.TacoConfig(group_size=64),
            sequence_parallel=True,
        )
        losses = {}
        for name, model in (("ref", ref), ("plain", plain), ("compressed", packed)):
            loss = model(ids, labels=ids).loss
            loss.backward()
            losses[name] = loss.item()
        with torch.no_grad():
            generated = packed.generate(ids[:, :4], max_new_tokens=4, do_sample=False, pad_token_id=0)
        out[arch] = {**losses, "generated": generated.shape[1], "device": str(packed.lm_head.weight.device)}
    return out


def _autocast_worker() -> dict:
    """fp32 weights under CUDA bf16 autocast, against the same model on one process under it
    (tests/test_precision.py's comparison, on the GPU: cuBLAS bf16 products)."""
    from test_precision import _bound, _grads_rel_rms, _rel_rms, _step

    torch.cuda.set_device(0)
    out = {}
    for arch in ("qwen3", "gpt2"):
        for sp in (False, True):
            ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
            ref = tiny_model(arch).cuda()
            model = taco_accel.parallelize(copy.deepcopy(ref), compression=None, sequence_parallel=sp)
            got, want = (_step(m, ids, ids, torch.bfloat16, torch.bfloat16) for m in (model, ref))
            out[arch, sp] = {"logits": _rel_rms(got["logits"], want["logits"]), "grads": _grads_rel_rms(model, ref),
                             "logits_bound": _bound(torch.bfloat16, got["n_fwd"], want["n_fwd"]),
                             "grads_bound": _bound(torch.bfloat16, got["n_all"], want["n_all"]),
                             "dtype": str(got["logits"].dtype), "device": str(got["logits"].device)}
    return out


def test_cuda_bf16_autocast_matches_one_process():
    for result in run_ranks(_autocast_worker, 2):
        for key, r in result.items():
            assert r["device"].startswith("cuda") and r["dtype"] == "torch.bfloat16", (key, r)
            # relative rms within test_precision's rounding bound, u (sqrt N_a + sqrt N_b) / sqrt 3
            assert r["logits"] < r["logits_bound"] and r["grads"] < r["grads_bound"], (key, r)


def test_bf16_triton_codec_on_cuda():
    for result in run_ranks(_worker, 2):
        for arch, r in result.items():
            assert r["device"].startswith("cuda"), r
            assert abs(r["plain"] - r["ref"]) / r["ref"] < 1e-2, (arch, r)  # bf16 rounding
            assert abs(r["compressed"] - r["ref"]) / r["ref"] < 2e-2, (arch, r)
            assert r["generated"] == 8


HOST_READS = ("__bool__", "item", "tolist", "__float__", "__int__", "nonzero")


class CudaReads(torch.overrides.TorchFunctionMode):
    """How many host reads of CUDA tensors the torch calls inside it made (``count``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        self.count += name in HOST_READS and bool(args) and torch.is_tensor(args[0]) and args[0].is_cuda
        return func(*args, **(kwargs or {}))


def _wire_worker() -> dict:
    """A training step's wire check on CUDA tensors, `codec.api.READ_AT_ONCE` as it is (the GPU
    defers its header reads): a compressed tp=2 model whose rank 1 changes a forward site's format
    at step 2 (the wire size stays), the step check of `taco_accel.Accelerator`
    (`integrations.wire.StepWire`) around the optimizer step as its optimizer wrapper calls it:
    with its own all-reduce of the flag ("step"), folded into the gradient norm's all-reduce as
    ``clip_grad_norm_`` does ("clip"), carried by the fp16 gradient scaler ("fp16"). Per case, the
    host reads of CUDA tensors in each step's forward, backward and collectives (the first step's
    agreement and batch checks read the host; the second's nothing), in the check and optimizer
    step, and where the error came."""
    import torch.distributed as dist

    from taco_accel.integrations.wire import StepWire
    from taco_accel.parallel import clip_grad_norm_
    from taco_accel.parallel.grad_scaler import MeshGradScaler

    torch.cuda.set_device(0)
    device, out = torch.device("cuda", 0), {}
    for case in ("step", "clip", "fp16"):
        model = taco_accel.parallelize(tiny_model("qwen3").cuda(), compression=taco_accel.TacoConfig(group_size=32))
        scaler = MeshGradScaler("cuda", init_scale=2.0**10) if case == "fp16" else None  # no overflow here
        wire = StepWire(lambda m=model: [m.taco.sites.ledger], device, dist.get_world_size(), True, scaler)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
        got = {"model_reads": [], "step_reads": [], "step": None, "message": None}
        for step in range(4):
            if step == 2 and dist.get_rank() == 1:
                site = model.taco.sites["layers.0.mlp.down_proj/fwd"]
                site.config = site.config.replace(format="e5m2")
            with CudaReads() as model_reads, torch.autocast("cuda", torch.float16, enabled=scaler is not None):
                loss = model(ids, labels=ids).loss
                (loss if scaler is None else scaler.scale(loss)).backward()
            weight = model.lm_head.weight.detach().clone()
            scale = None if scaler is None else scaler.get_scale()
            try:
                with CudaReads() as step_reads:
                    if case == "clip":
                        clip_grad_norm_([], list(model.parameters()), 1.0, finish=False, extra=wire.fold())
                    wire.before_step()
                    opt.step() if scaler is None else scaler.step(opt)
                if scaler is not None:
                    scaler.update()
                    wire.after_step(scaler.get_scale() < scale)  # a skipped step backs the scale off
            except taco_accel.WireFormatError as error:
                got.update(step=step, message=str(error), unchanged=torch.equal(weight, model.lm_head.weight),
                           nan_loss=bool(loss.isnan()))
                break
            opt.zero_grad()
            got["model_reads"].append(model_reads.count)
            got["step_reads"].append(step_reads.count)
        out[case] = got
    return out


def test_a_wire_error_reaches_the_optimizer_step_on_a_gpu():
    """On the GPU a chunk of another config reads as NaN without a host sync; the optimizer step
    that would use it raises a WireFormatError on every rank, naming the site, with the weights
    untouched (fp16: not a silently skipped step); each step before it reads the host once, in
    the step check (fp16: the scaler's own read), and a steady step nowhere in its forward,
    backward and collectives."""
    for rank, result in enumerate(run_ranks(_wire_worker, 2)):
        for case, got in result.items():
            assert got["step"] == 2 and got["unchanged"] and got["nan_loss"], (rank, case, got)
            assert got["message"].startswith("layers.0.mlp.down_proj/fwd: "), (rank, case, got)
            assert got["step_reads"] == [1, 1] and got["model_reads"][1] == 0, (rank, case, got)
