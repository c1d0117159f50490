"""What one training step costs at every door, against the plain loop a user would write instead.

Each door of `step_probes` runs its last step inside a `step_probes.Probe` (at tp=1 in one
process, at tp=2 on two gloo ranks):

- host syncs (`taco_accel.bench.syncs.HostSyncs`, counted as a CUDA run would pay them): no more
  than the plain reference's (a plain Accelerate loop with the same clip; transformers' own
  Trainer for ``taco_trainer``'s). Counts, not times;
- no tensor of ``tokens x vocab / tp`` elements (one forward's logits) or more: the head and loss
  run fused, in chunks (`step_probes.CHUNK` tokens);
- no parameter still holding a gradient after the step (freed as a plain loop frees them, not
  carried through evaluation and checkpoint saves).
"""

from __future__ import annotations

import pytest
from harness import case, run_ranks

import step_probes

DOORS = ["loop", "finetuner", "recipes", "trainer"]
CASES = [(door, tp) for tp in (1, 2) for door in DOORS]
IDS = [f"{door}-tp{tp}" for door, tp in CASES]


def _doors(doors: list[str], tp: int, folder: str) -> dict:
    return step_probes.run_doors(doors, tp, folder)


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    """``{tp: results by rank}``: the plain references and the doors at tp=1, the doors at tp=2."""
    folder = tmp_path_factory.mktemp("steps")
    return {1: run_ranks(_doors, 1, ["plain", "plain_trainer", *DOORS], 1, str(folder / "tp1")),
            2: run_ranks(_doors, 2, DOORS, 2, str(folder / "tp2"))}


def _events(result: dict) -> str:
    return "\n".join(f"  {kind}: {where}" for kind, where in result["events"])


@pytest.mark.parametrize("door, tp", CASES, ids=IDS)
def test_no_more_host_syncs_than_the_plain_loop(measured, door, tp):
    plain, = case(measured[1], step_probes.PLAIN[door])
    for r in case(measured[tp], door):
        assert r["syncs"] <= plain["syncs"], f"{door} at tp={tp}:\n{_events(r)}\nplain:\n{_events(plain)}"


@pytest.mark.parametrize("door, tp", CASES, ids=IDS)
def test_no_tensor_of_logits_size(measured, door, tp):
    limit = step_probes.TOKENS * step_probes.VOCAB // tp
    for r in case(measured[tp], door):
        assert not r["over"], f"{door} at tp={tp}: tensors of {limit} elements or more: {r['over']}"
        assert r["largest"][0] > 0, r  # the probe saw the step's ops


@pytest.mark.parametrize("door, tp", CASES, ids=IDS)
def test_gradients_are_freed_after_the_step(measured, door, tp):
    for r in case(measured[tp], door):
        assert r["grads_held"] == 0, r


def test_the_plain_references_ran(measured):
    """The references themselves: the plain loop reads its loss once; the plain Trainer reads it for its
    NaN filter (twice: isnan, isinf); each padded batch costs transformers two reads in its mask."""
    plain, = case(measured[1], "plain")
    trainer, = case(measured[1], "plain_trainer")
    assert plain["syncs"] >= 1 and trainer["syncs"] >= 2, (plain, trainer)
