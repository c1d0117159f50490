"""Copies of a parallel model: ``copy.deepcopy`` gives a working model on the same process
groups with its own sites, statistics and gradient hooks; pickling refuses in one line.

One 2-rank gloo launch (tp=2, compression on, sequence parallelism: replicated norms whose
gradients a per-model hook sums), every case apart; the emulated model in one process.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from harness import case, per_case, run_ranks

import taco_accel
from taco_accel.errors import NotPicklableError
from taco_accel.models.tiny import tiny_model


def _ids():
    return torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _copies() -> dict:
    model = taco_accel.parallelize(tiny_model("qwen3"), compression="on", sequence_parallel=True)
    ids = _ids()
    model(ids, labels=ids).loss.backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)
    model.taco.sites.pop_stats()
    twin = copy.deepcopy(model)

    def same_outputs():
        with torch.no_grad():
            return torch.equal(model(ids).logits, twin(ids).logits)

    def trains_alone():
        before = {k: v.clone() for k, v in model.state_dict().items()}
        model.taco.sites.pop_stats()
        twin(ids, labels=ids).loss.backward()
        grads = _grads(twin)
        torch.optim.SGD(twin.parameters(), lr=0.1).step()
        return {"grads_equal": sorted(grads) == sorted(expected) and all(torch.equal(grads[k], expected[k])
                                                                          for k in expected),
                "original_grads": [n for n, p in model.named_parameters() if p.grad is not None],
                "original_kept": all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()),
                "stats": (len(model.taco.sites.pop_stats()), len(twin.taco.sites.pop_stats()))}

    def own_handles():
        return {s.handle for s in model.taco.sites.values()} & {s.handle for s in twin.taco.sites.values()}

    def pickled():
        out = []
        for dump in (pickle.dumps, lambda m: torch.save(m, io.BytesIO())):
            try:
                dump(model)
            except NotPicklableError as e:
                out.append(str(e))
        return out

    def reference():
        from trl.experimental.utils import create_reference_model

        ref = create_reference_model(model)
        with torch.no_grad():
            return {"equal": torch.equal(ref(ids).logits, model(ids).logits),
                    "frozen": not any(p.requires_grad for p in ref.parameters())}

    return per_case({"outputs": same_outputs, "trains": trains_alone, "handles": own_handles, "pickle": pickled,
                     "reference": reference})


@pytest.fixture(scope="module")
def copies():
    return run_ranks(_copies, 2)


# the copy runs the same operations on the same values over the same groups in the same order:
# its numbers are the original's bit for bit (no tolerance)
def test_a_deepcopy_gives_the_same_outputs(copies):
    assert case(copies, "outputs") == [True, True]


def test_a_deepcopy_trains_on_its_own_with_its_own_hooks_and_statistics(copies):
    for got in case(copies, "trains"):
        assert got["grads_equal"]  # the replicated norms' gradient sums ran on the copy's parameters
        assert got["original_grads"] == [] and got["original_kept"]
        assert got["stats"][0] == 0 and got["stats"][1] > 0  # the copy's traffic in its own ledger only


def test_a_deepcopy_has_its_own_site_handles(copies):
    assert case(copies, "handles") == [set(), set()]


def test_pickling_a_parallel_model_says_why_not_and_what_to_do(copies):
    for messages in case(copies, "pickle"):
        assert len(messages) == 2  # pickle.dumps and torch.save alike
        for message in messages:
            assert "process groups" in message and "save_pretrained" in message and "save_state" in message
            assert "\n" not in message


def test_trl_create_reference_model_of_a_parallel_model(copies):
    assert case(copies, "reference") == [{"equal": True, "frozen": True}] * 2


def test_a_deepcopy_of_an_emulated_model_has_its_own_sites_group_and_statistics():
    """The copy's sites, emulated group and ledger are its own: the custom op its compiled graphs
    call (``taco::emulated``, by handle) still finds its group once the original is gone, and
    ``pop_comm_stats`` (every ledger of the process) reports the copy's traffic."""
    import gc

    from taco_accel import comm

    model = taco_accel.parallelize(tiny_model("qwen2"), tp=2, emulate=True, compression="on")
    twin = copy.deepcopy(model)
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, twin(ids).logits)
    assert not {s.handle for s in model.taco.sites.values()} & {s.handle for s in twin.taco.sites.values()}
    comm.pop_comm_stats()
    with torch.no_grad():
        model(ids)
    alone = {name: figures.calls for name, figures in model.taco.sites.pop_stats().items()}
    with torch.no_grad():
        twin(ids)
    # the same forward on the copy: the same calls per site, found by the process-wide pop
    assert {name: figures.calls for name, figures in comm.pop_comm_stats().items()} == alone != {}
    group, site = twin.taco.emulator, next(iter(twin.taco.sites.values()))
    assert group is not model.taco.emulator and group.handle != model.taco.emulator.handle
    del model
    gc.collect()
    xs = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(torch.ops.taco.emulated(xs, group.handle, site.handle_tensor, "all_reduce"),
                       group.collective("all_reduce", xs, site))  # what the compiled graph runs: the eager call
