"""``parallelize(..., emulate=True)``: tp virtual ranks in one process against real TP.

One 2-rank `run_ranks` launch: on every rank, for every family with and without sequence
parallelism (one case each, `harness.per_case`), a few SGD steps of real compressed TP and of
the emulation of the same two ranks, in lockstep, in the same process (so that both use the
same thread count and matmul kernels). The compression mixes formats, scale layouts, group
sizes per site and pieces, so every codec path is compared byte for byte.

What is equal by construction, and asserted bit for bit: every per-rank tensor (the same matmul
shapes, the same codec calls on the same bytes, sums of two ranks, which fp32 adds
commutatively), so the loss, the logits and the gradients of the sharded parameters. What is
not: the gradient of a parameter that several ranks hold whole (norms under sequence
parallelism, Qwen3's q/k norms, row-layer biases under SP), a sum over tokens that real TP takes
per rank and then across ranks, the emulation in one pass; asserted within the fp32 bound of
two orders of one sum, and copied from the emulation into the real model after each step, so
that every step starts from the same weights (otherwise one last-bit difference can flip an
FP8 rounding in a later step, and the runs drift apart by the codec's error, not by a bug).
The real model runs its unfused layers: the fused overlap path adds a region's input gradients
in its own order (test_overlap.py compares the two paths).
The single-process tests run without torch.distributed at all.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from harness import TINY_MODEL_FP32, case, fp32_bound, per_case, run_ranks

import taco_accel
from taco_accel import comm
from taco_accel.comm.emulated import EmulatedGroup
from taco_accel.models.state import shard_specs
from taco_accel.models.tiny import tiny_model, tiny_model_types
from taco_accel.tp.shards import ShardSpec

ARCHS = tuple(tiny_model_types())  # every registered family: one parity suite
STEPS = 3
CFG = taco_accel.TacoConfig()  # tiny tensors compress too
MIXED = taco_accel.Compression(
    "on",
    forward=CFG,
    backward=CFG.replace(scales="dual", random_signs=True),
    sites={"layers.0.*": CFG.replace(group_size=32, format="int8"), "lm_head/*": CFG.replace(format="e5m2")},
    piece_bytes=2048,  # several pieces per message
)


def _batch(vocab: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 8), generator=g)
    labels = ids.clone()
    labels[0, :2] = -100
    return ids, labels


def _term_sums(model, names: list[str]) -> dict:
    """Hooks that add up, per element of each parameter in ``names`` (a bias, or the weight of an
    elementwise norm ``y = w * xhat (+ b)``), the absolute values of the per-token terms its
    gradient sums and their count: ``{name: [sum |term|, count]}``, filled by forward/backward."""
    sums, modules = {}, dict(model.named_modules())
    owners: dict[str, list[str]] = {}
    for name in names:
        owner, _, attr = name.rpartition(".")
        param = modules[owner].get_parameter(attr)
        if attr == "bias" or (attr == "weight" and param.dim() == 1):
            owners.setdefault(owner, []).append(attr)
            sums[name] = [torch.zeros_like(param, dtype=torch.float64), 0]
    for owner, attrs in owners.items():

        def capture(m, args, out, owner=owner, attrs=attrs):  # a tensor hook: adds no autograd node
            y = out.detach().double()
            out.register_hook(lambda grad: record(m, grad.double(), y, owner, attrs))

        modules[owner].register_forward_hook(capture)

    def record(m, g, y, owner, attrs):
        bias = m.bias.detach().double() if getattr(m, "bias", None) is not None else 0.0
        for attr in attrs:
            terms = g if attr == "bias" else g * (y - bias) / m.weight.detach().double()
            entry = sums[f"{owner}.{attr}"]
            entry[0] += terms.abs().reshape(-1, terms.shape[-1]).sum(0)
            entry[1] += terms.numel() // terms.shape[-1]

    return sums


def _lockstep(arch: str, sp: bool) -> dict:
    """Real tp=2 on the world and the emulation of both ranks, STEPS SGD steps in lockstep; per
    step what differs on this rank and the statistics of both.

    SGD, not Adam: Adam divides by |g|, which turns the fp32 rounding of a near-zero
    gradient into a full step, with or without compression."""
    ref, rank = tiny_model(arch), dist.get_rank()
    ids, labels = _batch(ref.config.vocab_size)
    real = taco_accel.parallelize(copy.deepcopy(ref), compression=MIXED, sequence_parallel=sp)
    real.taco.overlap.enabled = False  # the unfused layers (see the module docstring)
    emu = taco_accel.parallelize(copy.deepcopy(ref), tp=2, compression=MIXED, sequence_parallel=sp, emulate=True)
    specs = shard_specs(real)
    replicated = [n for n, _ in emu.named_parameters() if n not in specs]
    terms = _term_sums(emu, replicated)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (real, emu)]
    steps = []
    for step in range(STEPS):
        outs, stats = [], []
        for model, opt in zip((real, emu), opts):
            comm.pop_comm_stats()
            opt.zero_grad()
            out = model(ids, labels=labels)
            out.loss.backward()
            outs.append(out)
            stats.append({  # the sites of the table (the emulation skips always-plain bookkeeping sites)
                k: (v.calls, v.compressed_calls, v.bytes_sent, v.bytes_uncompressed)
                for k, v in comm.pop_comm_stats().items() if k in model.taco.sites
            })
        logits = outs[1].logits.detach()
        if outs[0].logits.shape != logits.shape:  # vocab-parallel logits: this rank's columns
            logits = real.lm_head.shard.on_dim(-1).take(logits, rank)
        sharded = [n for n in specs if not torch.equal(real.get_parameter(n).grad,
                                                       specs[n].take(emu.get_parameter(n).grad, rank))]
        excess = {}  # replicated gradients: |real - emulated| over the fp32 bound of two orders of a sum
        for n in replicated:
            diff = (real.get_parameter(n).grad - emu.get_parameter(n).grad).abs().double()
            bound = 0.0
            if n in terms:  # N terms summed in any two orders: each within gamma_N * sum |term| of the exact sum
                total, count = terms[n]
                bound = fp32_bound(count, 1.0) * total
                terms[n] = [torch.zeros_like(total), 0]  # the next step's terms
            if (diff > bound).any():  # a parameter without known terms (bound 0): bit for bit
                excess[n] = float((diff - bound).max())
        steps.append({
            "loss": (outs[0].loss.item(), outs[1].loss.item()),
            "logits_equal": torch.equal(outs[0].logits.detach(), logits),
            "sharded_grads_differ": sharded, "replicated_over_bound": excess,
            "stats": stats,
        })
        for opt in opts:
            opt.step()
        with torch.no_grad():
            for n in replicated:  # the same weights for the next step (see the module docstring)
                real.get_parameter(n).copy_(emu.get_parameter(n))
    return {"steps": steps, "sites": (list(real.taco.sites), list(emu.taco.sites))}


def _worker() -> dict:
    return per_case({(arch, sp): functools.partial(_lockstep, arch, sp) for arch in ARCHS for sp in (False, True)})


@pytest.fixture(scope="module")
def measured():
    return run_ranks(_worker, 2)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_emulation_equals_real_compressed_tp(measured, arch, sp):
    for r in case(measured, (arch, sp)):
        for step, s in enumerate(r["steps"]):
            real_loss, emu_loss = s["loss"]
            assert real_loss == emu_loss, (step, s["loss"])  # bit for bit (module docstring)
            assert s["logits_equal"], step
            assert not s["sharded_grads_differ"], (step, s["sharded_grads_differ"])
            assert not s["replicated_over_bound"], (step, s["replicated_over_bound"])
            assert s["stats"][0] == s["stats"][1], step  # calls, compressed calls and bytes per site
        assert r["sites"][0] == r["sites"][1]  # the same names, in the same order


# -- single process, no torch.distributed --------------------------------------------------------


def test_runs_without_distributed_and_matches_the_model_uncompressed():
    assert not dist.is_initialized()
    ref = tiny_model("llama")  # one kv head: replicated on all 4 ranks
    model = taco_accel.parallelize(copy.deepcopy(ref), tp=4, compression=None, emulate=True)
    ids, labels = _batch(128)
    out, expected = model(ids, labels=labels), ref(ids, labels=labels)
    out.loss.backward()
    expected.loss.backward()
    tol = TINY_MODEL_FP32  # the same products, sums split over the virtual ranks, in any thread count
    assert abs(out.loss.item() - expected.loss.item()) < tol
    assert float((out.logits - expected.logits).detach().abs().max()) < tol
    for name, param in model.named_parameters():
        assert param.shape == ref.get_parameter(name).shape  # whole parameters, transformers names
        assert float((param.grad - ref.get_parameter(name).grad).abs().max()) < tol, name
    assert model.taco.emulated and model.taco.tp == 4 and "tp=4, emulated" in repr(model.model.layers[0].mlp.down_proj)


def test_compressed_emulation_is_close_and_counts_every_site():
    ref = tiny_model("gpt2")
    model = taco_accel.parallelize(copy.deepcopy(ref), tp=4, compression=CFG, sequence_parallel=True, emulate=True)
    ids, labels = _batch(130)
    comm.pop_comm_stats()
    comm.set_error_sampling(1)
    try:
        loss = model(ids, labels=labels).loss
        loss.backward()
    finally:
        comm.set_error_sampling(0)
    stats = comm.pop_comm_stats()
    # a sanity bound (every message within the codec's few percent; the loss, a mean of smooth
    # functions of them, moves by a small fraction of that): the per-message bound is below
    assert abs(loss.item() - ref(ids, labels=labels).loss.item()) < 5e-3 * loss.item()
    assert set(model.taco.sites.group_sizes()) <= {s for s, v in stats.items() if v.compressed_calls}
    assert all(v.bytes_sent < v.bytes_uncompressed for v in stats.values())
    assert all(0 < v.error_max < 0.1 for v in stats.values())  # sampled against the exact float64 result


def test_generate_and_save_like_the_transformers_model(tmp_path):
    from transformers import AutoModelForCausalLM

    ref = tiny_model("qwen2").eval()
    model = taco_accel.parallelize(copy.deepcopy(ref), tp=2, compression=None, emulate=True).eval()
    prompt = torch.tensor([[1, 2, 3]])
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt))
    assert torch.equal(model.generate(prompt, **kw), ref.generate(prompt, **kw))
    taco_accel.save_pretrained(model, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, value in ref.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


def test_errors_match_real_tp():
    with pytest.raises(ValueError, match=r"tp=3 does not divide num_attention_heads=4; use a tp degree in \[1, 2, 4\]"):
        taco_accel.parallelize(tiny_model("qwen2"), tp=3, emulate=True)
    model = tiny_model("llama", num_attention_heads=12, num_key_value_heads=3, hidden_size=48)
    with pytest.raises(ValueError, match=r"tp=4 and num_key_value_heads=3"):
        taco_accel.parallelize(model, tp=4, emulate=True)
    with pytest.raises(ValueError, match=r"emulate=True needs the number of ranks"):
        taco_accel.parallelize(tiny_model("gpt2"), emulate=True)
    with pytest.raises(ValueError, match="already parallelised"):
        taco_accel.parallelize(taco_accel.parallelize(tiny_model("gpt2"), tp=2, emulate=True), tp=2, emulate=True)


def test_emulated_group_matches_its_contract():
    group = EmulatedGroup(4)
    xs = [torch.randn(8, 64, generator=torch.Generator().manual_seed(r)) for r in range(4)]
    cfg = CFG.replace(group_size=32)
    total = sum(xs)
    assert torch.allclose(group.all_reduce(xs, None), total)
    # E4M3: about 2.6% rms per encoding, two encodings in a sum (tests/test_comm.py BOUND): 5%
    assert (group.all_reduce(xs, cfg) - total).norm() < 0.05 * total.norm()
    rows = group.reduce_scatter(xs, cfg)
    assert [r.shape for r in rows] == [torch.Size([2, 64])] * 4
    assert (torch.cat(rows) - total).norm() < 0.05 * total.norm()
    gathered = group.all_gather(xs, cfg)
    assert gathered.shape == (32, 64) and (gathered - torch.cat(xs)).norm() < 0.05 * torch.cat(xs).norm()
    with pytest.raises(ValueError, match="needs 4 tensors"):
        group.all_reduce(xs[:3], cfg)
    with pytest.raises(ValueError, match="divisible by the group size 4"):
        group.reduce_scatter([x[:3] for x in xs], cfg)


@pytest.mark.parametrize(
    "split",
    [ShardSpec.even(8, 4), ShardSpec.heads(1, 2, 4), ShardSpec.concat([ShardSpec.even(4, 2), ShardSpec.even(6, 2)]),
     ShardSpec.even(6, 3, dim=1)],
    ids=["even", "replicated", "segments", "dim1"],
)
def test_rank_parts_gradient_equals_slicing(split):
    """The rank parts of a tensor carry the same gradient as plain slices of it (which autograd
    would assemble from full-size zero tensors): bit for bit for disjoint and segmented parts, to
    fp32 rounding for parts replicated on several ranks."""
    from taco_accel.tp.emulate import RankParts

    torch.manual_seed(0)
    full = torch.randn(*[split.full_size if d == split.dim else 3 for d in range(2)], requires_grad=True)
    weights = [torch.randn(split.size(p)) for p in range(split.tp)]

    def loss(parts):
        return sum((part.movedim(split.dim, 0).T * w).sum() for part, w in zip(parts, weights))

    (got,) = torch.autograd.grad(loss(RankParts(split)(full)), full)
    (want,) = torch.autograd.grad(loss([split.take(full, p) for p in range(split.tp)]), full)
    if split.replicas == 1:
        assert torch.equal(got, want)
    else:  # the replicas' gradients add up in rank order, autograd's in its own: fp32 rounding apart
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def _per_rank(kind: str, xs: torch.Tensor, codec) -> tuple[torch.Tensor, int]:
    """``kind`` through every virtual rank's own pieces (`run_compressed`: what real ranks run)."""
    from taco_accel.comm.compressed import Workspace
    from taco_accel.comm.emulated import run_compressed

    world, x = xs.shape[0], xs[0]
    if kind == "reduce_scatter":
        out = torch.empty_like(x)
        outs = list(out.view(world, -1).unbind(0))
    else:
        out = torch.empty_like(x) if kind == "all_reduce" else x.new_empty((world * x.shape[0], *x.shape[1:]))
        outs = [out] + [None] * (world - 1)
    sent = run_compressed(kind, list(xs.unbind(0)), outs, codec, 0, [Workspace() for _ in range(world)])
    return out, sent


@pytest.mark.parametrize("world", [2, 3, 4])
def test_stacked_collectives_equal_every_ranks_own_pieces(world):
    """`comm.stacked` (one codec call for all virtual ranks) against each rank's own codec calls:
    the same values bit for bit (the codec works group by group, and every chunk is whole
    groups) and the same bytes sent, for whole and padded groups, both scale layouts and formats."""
    from taco_accel.codec.layout import length_tag
    from taco_accel.comm import stacked
    from taco_accel.comm.kinds import KINDS
    from taco_accel.comm.compressed import Workspace

    g = torch.Generator().manual_seed(world)
    codecs = [taco_accel.TacoConfig(group_size=32),
              taco_accel.TacoConfig(group_size=64, scales="dual", random_signs=True, format="int8")]
    for codec in codecs:
        for cols in (37, 128):  # padded groups, whole chunks
            for dtype in (torch.float32, torch.bfloat16):
                for kind, rows in (("all_reduce", 5), ("reduce_scatter", 3 * world), ("all_gather", 3)):
                    xs = torch.randn(world, rows, cols, generator=g).to(dtype)
                    got, sent = stacked.run(KINDS[kind], xs, codec, length_tag(xs[0].numel()), Workspace())
                    want, want_sent = _per_rank(kind, xs, codec)
                    assert torch.equal(got, want) and sent == want_sent, (kind, codec, cols, dtype)


def test_emulation_bench_runs_every_variant(capsys):
    """`taco_accel.bench.emulation` on the CPU, nano preset, one step each: a row per variant with
    its figures (values are machine-dependent: only their presence and signs are checked)."""
    from taco_accel.bench import emulation

    emulation.main(["--preset", "nano", "--seq", "16", "--batch", "1", "--steps", "1", "--warmup", "0", "--tp", "2"])
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split("|")[1].strip() for r in rows] == ["plain", "tp2 off", "tp2 on"], printed
    for row in rows:
        step, host, launches, ratio = (float(v) for v in row.split("|")[2:6])
        assert step > 0 and host >= 0 and launches > 0 and ratio > 0, row
