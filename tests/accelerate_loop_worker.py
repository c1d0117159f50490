"""A user's own Accelerate loop around `taco_accel.Accelerator`, checked inside the launch against
the same training on one process. Started by tests/test_accelerator.py with ``accelerate
launch`` (the mesh sizes come from the launch config); rank 0 writes the figures as JSON.

Every rank also runs the one-process reference itself (a plain transformers model, no
collectives), on the global micro-batches it gathers from the data-parallel replicas.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import traceback

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM, Qwen2Config

import taco_accel

ACCUM, BATCH, CLIP, STEPS, SAVE_AT = 2, 2, 0.5, 6, 3
DATA = torch.randint(0, 128, (48, 16), generator=torch.Generator().manual_seed(0))


def fresh_model(seed: int = 0):
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(config)


def optimizer_and_schedule(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))


def loader(data=DATA, batch: int = BATCH):
    return DataLoader(TensorDataset(data), batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(7))


def train(compression, *, seed: int = 0, save: str | None = None, resume: str | None = None, sizes=None,
          **options):
    """STEPS optimizer steps of ACCUM micro-batches (from step SAVE_AT when resuming); ``sizes``: a
    ParallelismConfig instead of the launch config's; ``options``: more Accelerator arguments."""
    acc = taco_accel.Accelerator(gradient_accumulation_steps=ACCUM, compression=compression, parallelism_config=sizes,
                                 **options)
    model = fresh_model(seed)
    opt, sched = optimizer_and_schedule(model)
    model, opt, data, sched = acc.prepare(model, opt, loader(), sched)
    step = 0
    if resume:
        acc.load_state(resume)
        data, step = acc.skip_first_batches(data, SAVE_AT * ACCUM), SAVE_AT
    acc.compression_stats()  # start counting here
    rows, micro = [], []
    for (ids,) in data:
        with acc.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss)
            norm = acc.clip_grad_norm_(model.parameters(), CLIP) if acc.sync_gradients else None
            opt.step()
            sched.step()
            opt.zero_grad()
        micro.append((acc.gather(ids), acc.gather(loss.detach()).mean().item()))
        if acc.sync_gradients:
            step += 1
            rows.append({"loss": sum(m[1] for m in micro) / len(micro), "grad_norm": norm.item(),
                         "batches": [m[0] for m in micro], "lr": sched.get_last_lr()[0]})
            micro = []
            if save and step == SAVE_AT:
                acc.save_state(save)
            if step == STEPS:
                break
    return acc, model, rows


def reference(rows: list[dict], replicas: int, bf16: bool = False) -> tuple[list[dict], dict]:
    """The same steps on one process: global micro-batches, the same optimizer and schedule
    (stepped once per replica, as Accelerate does for a DataLoader split over replicas);
    ``bf16``: the forward in bf16 autocast, as Accelerate's mixed_precision="bf16" runs it."""
    model = fresh_model(0)
    opt, sched = optimizer_and_schedule(model)
    out = []
    for row in rows:
        opt.zero_grad()
        losses = []
        for ids in row["batches"]:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = model(input_ids=ids, labels=ids).loss
            (loss / ACCUM).backward()
            losses.append(loss.item())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        for _ in range(replicas):
            sched.step()
        out.append({"loss": sum(losses) / len(losses), "grad_norm": norm.item(), "lr": sched.get_last_lr()[0]})
    return out, model


def parity(compression, sizes=None) -> dict:
    acc, model, rows = train(compression, sizes=sizes)
    stats = acc.compression_stats()
    ref_rows, ref_model = reference(rows, acc.parallel_dims.dp)
    ref_state = ref_model.state_dict()
    full = acc.get_state_dict(model)
    layer = acc.unwrap_model(model).model.layers[0].mlp.gate_proj
    with tempfile.TemporaryDirectory() as tmp:
        folder = [tmp if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(folder, src=0)
        acc.save_model(model, os.path.join(folder[0], "save_model"))
        acc.unwrap_model(model).save_pretrained(os.path.join(folder[0], "habit"))  # the transformers habit
        loaded_diff = final_loss = None
        if dist.get_rank() == 0:
            loaded_diff = 0.0
            for name in ("save_model", "habit"):
                loaded = AutoModelForCausalLM.from_pretrained(os.path.join(folder[0], name))
                loaded_diff = max([loaded_diff] + [(v - full[k]).abs().max().item() for k, v in loaded.state_dict().items()])
            with torch.no_grad():  # the trained weights, as saved, against the reference's, on every batch seen
                batches = [ids for r in rows for ids in r["batches"]]
                final_loss = [(loaded(input_ids=ids, labels=ids).loss.item(), ref_model(input_ids=ids, labels=ids).loss.item())
                              for ids in batches]
        dist.barrier()
    return {
        "losses": [r["loss"] for r in rows], "ref_losses": [r["loss"] for r in ref_rows],
        "grad_norms": [r["grad_norm"] for r in rows], "ref_grad_norms": [r["grad_norm"] for r in ref_rows],
        "lrs": [r["lr"] for r in rows], "ref_lrs": [r["lr"] for r in ref_rows],
        "final_losses": final_loss,
        "keys_equal": sorted(full) == sorted(ref_state),
        "local_gate_rows": layer.weight.shape[0] if not hasattr(layer.weight, "to_local") else layer.weight.to_local().shape[0],
        "saved_model_diff": loaded_diff,
        "bytes_saved": stats["comm/bytes_saved"], "bytes_sent": stats["comm/bytes_sent"],
        # the replicas saw different batches, the tp ranks of a replica the same ones
        "distinct_batches": len({tuple(b.flatten().tolist()) for r in rows for b in r["batches"]}),
    }


def bf16() -> dict:
    """mixed_precision="bf16" (as ``accelerate launch --mixed_precision bf16`` gives it), with and
    without sequence parallelism, against one process under the same autocast. Accelerate fixes
    the mixed precision once per process state: a fresh state here, and again after."""
    from accelerate.state import AcceleratorState

    out = {}
    for sp in (False, True):
        AcceleratorState._reset_state()
        _, _, rows = train(None, mixed_precision="bf16", sequence_parallel=sp)
        ref_rows, _ = reference(rows, 1, bf16=True)
        out["sp" if sp else "tp"] = {"losses": [r["loss"] for r in rows], "ref_losses": [r["loss"] for r in ref_rows],
                                     "grad_norms": [r["grad_norm"] for r in rows],
                                     "ref_grad_norms": [r["grad_norm"] for r in ref_rows]}
    AcceleratorState._reset_state()
    return out


WIRE_STEP = 2  # the optimizer step whose collectives meet a chunk of another config
HOST_READS = ("__bool__", "item", "tolist", "__float__", "__int__", "nonzero")  # what makes the host wait for a GPU


class HostReads(torch.overrides.TorchFunctionMode):
    """How many host reads of tensors the torch calls inside it made (``count``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in HOST_READS
        return func(*args, **(kwargs or {}))


def wire_errors() -> dict:
    """A compressed chunk of another config at optimizer step WIRE_STEP (rank 1, of the first tp
    group, changes a forward site's format: the wire size stays), the header reads deferred as on
    a GPU (`codec.api.READ_AT_ONCE` emptied, as TACO_DEFER_HEADER_READS=1 does): per case (with
    or without clipping; fp16), every rank's outcome: where the error came, the host reads of
    clipping and the optimizer step of each step before, whether the failing step left the
    weights alone."""
    from accelerate.state import AcceleratorState
    from taco_accel.codec import api

    saved, api.READ_AT_ONCE = api.READ_AT_ONCE, ()
    out = {}
    try:
        for case, clip, precision in (("clip", True, "no"), ("no_clip", False, "no"), ("fp16", True, "fp16")):
            AcceleratorState._reset_state()
            mine = _wire_run(clip, precision)
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            out[case] = every
    finally:
        api.READ_AT_ONCE = saved
        AcceleratorState._reset_state()
    return out


def _wire_run(clip: bool, precision: str) -> dict:
    acc = taco_accel.Accelerator(compression=taco_accel.TacoConfig(group_size=32), mixed_precision=precision)
    model = fresh_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)  # no host reads of its own
    model, opt, data = acc.prepare(model, opt, loader())
    got = {"reads": [], "step": None, "type": None, "message": None}
    for step, (ids,) in enumerate(data):
        if step == WIRE_STEP and dist.get_rank() == 1:
            site = acc.unwrap_model(model).taco.sites["layers.0.mlp.down_proj/fwd"]
            site.config = site.config.replace(format="e5m2")
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        weight = next(model.parameters()).detach().clone()
        try:
            with HostReads() as reads:
                if clip:
                    acc.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
            opt.zero_grad()
        except Exception as error:  # noqa: BLE001 - the outcome is what the test reads
            got.update(step=step, type=type(error).__name__, message=str(error), nan_loss=bool(loss.isnan()),
                       unchanged=torch.equal(weight, next(model.parameters()).detach()))
            break
        got["reads"].append(reads.count)
        if step == WIRE_STEP + 1:
            break
    return got


def resume(tmp: str) -> dict:
    folder = os.path.join(tmp, "ckpt")
    _, _, straight = train(None, save=folder)
    _, _, resumed = train(None, seed=1, resume=folder)  # other initial weights: everything comes from the checkpoint
    files = sorted(os.listdir(folder)) if dist.get_rank() == 0 else None
    return {"straight": [r["loss"] for r in straight], "resumed": [r["loss"] for r in resumed], "files": files}


def metrics() -> dict:
    """gather_for_metrics over an evaluation set that does not divide into the replicas' batches."""
    acc = taco_accel.Accelerator(compression=None)
    data = acc.prepare(DataLoader(TensorDataset(torch.arange(13).view(13, 1)), batch_size=2))
    objects = acc.gather_for_metrics([acc.process_index], use_gather_object=True)  # not in a DataLoader: all kept
    seen = [acc.gather_for_metrics(x).flatten().tolist() for (x,) in data]
    total = acc.reduce(torch.tensor([1.0]), "sum").item()
    mean = acc.reduce(torch.tensor([float(acc.process_index)]), "mean").item()
    try:
        acc.reduce(torch.tensor([1.0]), "max")
        refused = None
    except ValueError as e:
        refused = str(e)
    return {"seen": sorted(v for part in seen for v in part), "reduce_sum": total, "reduce_mean": mean,
            "objects": objects, "refused": refused}


def refusals() -> dict:
    """The unsafe paths: a plain Accelerator around a TP model, and a tp that the mesh does not have."""
    from accelerate import Accelerator, ParallelismConfig

    out = {}
    plain = Accelerator(cpu=True)
    model = taco_accel.parallelize(fresh_model(), tp=dist.get_world_size(), compression=None)
    opt, _ = optimizer_and_schedule(model)
    model, opt, data = plain.prepare(model, opt, loader())
    try:
        (ids,) = next(iter(data))
        model(input_ids=ids, labels=ids).loss.backward()
        out["plain"] = None
    except Exception as e:  # noqa: BLE001 - the message is what the test reads
        out["plain"] = f"{type(e).__name__}: {e}"
    model = taco_accel.parallelize(fresh_model(), tp=dist.get_world_size(), compression=None)
    acc = taco_accel.Accelerator(parallelism_config=ParallelismConfig(tp_size=1, dp_replicate_size=dist.get_world_size()))
    try:
        acc.prepare(model)
        out["mismatch"] = None
    except ValueError as e:
        out["mismatch"] = str(e)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--checks", default="parity,resume,metrics,refusals")
    args = p.parse_args()
    checks = args.checks.split(",")
    taco_accel.Accelerator(compression=None)  # starts the processes' group, as any first Accelerator does
    result = {}

    def run(key: str, check, *args) -> None:  # each check's error is its own result (per test)
        try:
            result[key] = check(*args)
        except Exception:  # noqa: BLE001 - reported by the test of this check
            result[key] = {"error": traceback.format_exc()}

    if "parity" in checks:
        run("off", parity, None)
        run("on", parity, taco_accel.TacoConfig(group_size=32))
    if "fsdp_parity" in checks:  # the same processes, the sizes passed in Python: dp=2 FSDP2 shards x tp=2
        from accelerate import ParallelismConfig

        sizes = ParallelismConfig(tp_size=2, dp_shard_size=2, dp_replicate_size=1)  # not the launch's dp_replicate_size
        run("fsdp_off", parity, None, sizes)
        run("fsdp_on", parity, taco_accel.TacoConfig(group_size=32), sizes)
    with tempfile.TemporaryDirectory() as tmp:
        shared = [tmp if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        if "resume" in checks:
            run("resume", resume, shared[0])
        dist.barrier()
    if "metrics" in checks:
        run("metrics", metrics)
    if "refusals" in checks:
        run("refusals", refusals)
    if "wire" in checks:
        run("wire", wire_errors)
    if "bf16" in checks:  # last: it changes Accelerate's process state
        run("bf16", bf16)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x))


if __name__ == "__main__":
    main()
