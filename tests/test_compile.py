"""torch.compile and CUDA graphs over compressed TP (the collectives are custom ops, `comm.ops`).

On two gloo ranks: dynamo's explain finds no graph break in a TP decoder layer with every
message compressed (TP and sequence parallel, two families), nor in the whole model; the
compiled layer's forward and backward equal eager ones, and the statistics and the auto
decisions are taken at run time inside the compiled graph. With CUDA: one training step of an
emulated compressed TP model captured in a CUDA graph and replayed (skipped on CPU).
"""

from __future__ import annotations

import copy

import pytest
import torch
from harness import run_ranks

import taco_accel
from taco_accel import comm
from taco_accel.models.tiny import tiny_model

ON = taco_accel.TacoConfig(threshold_bytes=0, group_size=32)


def _layer_call(model, layer_index: int, sp: bool):
    """Layer ``layer_index`` of a llama-like or GPT-2 model and its arguments for one (2, 8) batch."""
    torch.manual_seed(1)
    seq, tp = 8, model.taco.tp
    hidden = torch.randn(2, seq // tp if sp else seq, 64, requires_grad=True)
    model.taco.sequence.active = sp
    if model.config.model_type == "gpt2":
        return model.transformer.h[layer_index], (hidden,), {}
    pos = torch.arange(seq)[None]
    cos_sin = model.model.rotary_emb(torch.randn(1, seq, 64), pos)
    return model.model.layers[layer_index], (hidden,), dict(position_embeddings=cos_sin, position_ids=pos)


def _explain(arch: str, sp: bool) -> dict:
    import torch._dynamo

    model = taco_accel.parallelize(tiny_model(arch), compression=ON, sequence_parallel=sp)
    layer, args, kwargs = _layer_call(model, 1, sp)  # layer 0 also splits the sequence (a hook of its own)
    torch._dynamo.reset()
    layer_out = torch._dynamo.explain(layer)(*args, **kwargs)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    model_out = torch._dynamo.explain(model)(ids, labels=ids)
    code = "\n".join(m.code for g in layer_out.graphs for m in g.modules() if isinstance(m, torch.fx.GraphModule))
    return {
        "layer_breaks": layer_out.graph_break_count, "model_breaks": model_out.graph_break_count,
        "reasons": [str(r.reason)[:200] for r in (*layer_out.break_reasons, *model_out.break_reasons)],
        "ops": sorted({op for op in ("all_reduce", "all_gather", "reduce_scatter") if f"taco.{op}" in code}),
    }


def _compiled_step(arch: str, sp: bool, compression) -> dict:
    """Layer 1 compiled (aot_eager: AOTAutograd traces forward and backward) against eager."""
    ref = tiny_model(arch)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    compiled = taco_accel.parallelize(copy.deepcopy(ref), compression=compression, sequence_parallel=sp)
    eager = taco_accel.parallelize(copy.deepcopy(ref), compression=compression, sequence_parallel=sp)
    layers = compiled.model.layers if arch != "gpt2" else compiled.transformer.h
    layers[1] = torch.compile(layers[1], backend="aot_eager")
    comm.pop_comm_stats()
    out_c = compiled(ids, labels=ids)
    out_c.loss.backward()
    stats = {k: (v.calls, v.compressed_calls) for k, v in comm.pop_comm_stats().items() if ".1." in k}
    out_e = eager(ids, labels=ids)
    out_e.loss.backward()
    grads = max(float((p.grad - q.grad).abs().max()) for p, q in zip(compiled.parameters(), eager.parameters()))
    decided = lambda model: {k: d["compressed"] for k, d in model.taco.sites.decisions().items()}  # noqa: E731
    return {"loss": float((out_c.loss - out_e.loss).abs()), "grads": grads, "stats": stats,
            "scale": float(out_e.loss), "decisions": decided(compiled), "eager_decisions": decided(eager)}


def _worker() -> dict:
    out = {}
    for arch in ("llama", "gpt2"):
        for sp in (False, True):
            out[arch, sp, "explain"] = _explain(arch, sp)
            out[arch, sp, "step"] = _compiled_step(arch, sp, ON)
    out["auto"] = _compiled_step("llama", False, "auto")
    return out


@pytest.fixture(scope="module")
def measured():
    return run_ranks(_worker, 2)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_compressed_tp_compiles_without_graph_breaks(measured, arch, sp):
    for result in measured:
        r = result[arch, sp, "explain"]
        assert r["layer_breaks"] == 0 and r["model_breaks"] == 0, r["reasons"]
        # the collectives are in the graph (the backward bodies too: llama's replicated kv head sums its gradient)
        assert {"all_gather", "reduce_scatter"} <= set(r["ops"]) if sp else "all_reduce" in r["ops"], r


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_compiled_layer_equals_eager_and_reports_at_run_time(measured, arch, sp):
    for result in measured:
        r = result[arch, sp, "step"]
        assert r["loss"] < 1e-6 and r["grads"] < 1e-6, r  # the same codec calls on the same inputs
        fwd_bwd = [v for k, v in r["stats"].items() if k.endswith(("/fwd", "/bwd"))]
        assert fwd_bwd and all(calls == compressed == 1 for calls, compressed in fwd_bwd), r["stats"]


def test_auto_decides_inside_the_compiled_graph(measured):
    decisions = [result["auto"]["decisions"] for result in measured]
    assert decisions[0] == decisions[1]
    fwd_bwd = {k: v for k, v in decisions[0].items() if k.endswith(("/fwd", "/bwd")) and ".1." in k}
    assert fwd_bwd and all(v in (True, False) for v in fwd_bwd.values()), decisions[0]  # decided at run time
    auto = measured[0]["auto"]
    if auto["decisions"] == auto["eager_decisions"]:  # each model timed its own sites: they may differ
        assert auto["loss"] < 1e-6, auto
    else:
        assert auto["loss"] < 0.02 * auto["scale"], auto


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_compressed_training_step_in_a_cuda_graph():
    """One SGD step of an emulated tp=2 model, every message compressed (Triton codec), captured
    in a CUDA graph and replayed, against the same steps run eagerly."""
    ref = tiny_model("qwen2").cuda()
    ids = torch.randint(0, 128, (2, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(0))

    def build():
        model = taco_accel.parallelize(copy.deepcopy(ref), tp=2, compression=ON, emulate=True)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    graphed, opt = build()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: kernels compiled, auto decisions taken, allocator primed
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            graphed(ids, labels=ids).loss.backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        loss = graphed(ids, labels=ids).loss
        loss.backward()
        opt.step()
    eager, eager_opt = build()
    losses = []
    for step in range(3 + 3):  # the warm-up steps, then one replay per step (capturing ran nothing)
        eager_opt.zero_grad(set_to_none=True)
        eager_loss = eager(ids, labels=ids).loss
        eager_loss.backward()
        eager_opt.step()
        if step >= 3:
            graph.replay()
            losses.append((loss.item(), eager_loss.item()))
    # the graph replays the eager kernels but for AdamW's capturable form; under TACO a few codec
    # ties round the other way (seen on the H200: 5e-5 relative by the 4th step)
    for replayed, expected in losses:
        assert replayed == pytest.approx(expected, rel=1e-3), losses
