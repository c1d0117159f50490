"""`comm.kinds.KINDS` is the one source of what the code knows per collective kind: every kind the
collectives issue is registered there; the result shapes, the statistics' ring bytes, the
emulated results and the compiled graph's custom op answer from a kind's fields; the agreement
fingerprint carries the kind's name; and no module of comm keys a table by a kind's name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from taco_accel.comm import agreement, call
from taco_accel.comm.emulated import EmulatedGroup
from taco_accel.comm.kinds import KINDS, kind_of
from taco_accel.comm.stats import DEFAULT, ring_bytes

COMM = Path(call.__file__).parent
PUBLIC = ("all_reduce", "reduce_scatter", "all_gather")
PER_RANK = ("all_gather_by_rank", "reduce_scatter_by_rank")


def test_every_kind_issued_is_registered_and_an_unknown_one_is_refused():
    assert set(KINDS) == {*PUBLIC, *PER_RANK}
    assert all(KINDS[name].name == name for name in KINDS)
    assert [name for name in KINDS if KINDS[name].per_rank] == list(PER_RANK)
    with pytest.raises(ValueError, match="unknown collective 'all_to_all'"):
        kind_of("all_to_all")


def test_shapes_ring_bytes_emulation_and_ops_answer_from_the_registry():
    world, group = 3, EmulatedGroup(3)
    xs = [torch.randn(world * 2, 5, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    nbytes = xs[0].numel() * xs[0].element_size()
    for name in PUBLIC:
        out = getattr(group, name)(xs, site=f"kinds.{name}")  # plain: no codec
        shape = out[0].shape if name == "reduce_scatter" else out.shape  # reduce_scatter: one tensor per rank
        assert tuple(shape) == KINDS[name].output_shape(xs[0].shape, world)
        # the custom op's fake result (what a compiled graph's tracer is told): meta tensors run it
        handle = torch.tensor(0).to("meta")  # a site's handle: a 0-d int64 tensor (ops.handle_tensor)
        assert getattr(torch.ops.taco, name)(xs[0].to("meta"), handle, world).shape == shape
        every = torch.cat(out) if name == "reduce_scatter" else out  # the emulated op: every rank's rows
        assert torch.ops.taco.emulated(torch.stack(xs).to("meta"), 0, handle, name).shape == every.shape
        figures = DEFAULT.pop()[f"kinds.{name}"]
        # exact integer ring figures: the plain call sends what ring_bytes says, on both counts
        assert figures.bytes_sent == figures.bytes_uncompressed == ring_bytes(KINDS[name], nbytes, world)
    # the ring figures themselves: 2(P-1)/P, (P-1)/P of the input, (P-1) shards
    assert [ring_bytes(KINDS[n], 1200, 3) for n in PUBLIC] == [1600, 800, 2400]
    assert ring_bytes(KINDS["reduce_scatter_by_rank"], 1200, 3) == 800


def test_the_agreement_fingerprint_names_each_kind():
    for name in (*KINDS, "send"):
        words = agreement.fingerprint(name, torch.Size([4, 8]), torch.float32, None, False)[:agreement.NAME_WORDS]
        assert agreement._name(words) == name


def _keys_a_kind(node: ast.AST) -> bool:
    """A dict literal keyed by a kind's name, or a tuple / set of kind names (an ``in`` test)."""
    if isinstance(node, ast.Dict):
        names = [k.value for k in node.keys if isinstance(k, ast.Constant)]
    elif isinstance(node, (ast.Tuple, ast.Set)):
        names = [e.value for e in node.elts if isinstance(e, ast.Constant)]
    else:
        return False
    return sum(isinstance(n, str) and n in KINDS for n in names) >= (1 if isinstance(node, ast.Dict) else 2)


def test_no_comm_module_keys_a_table_by_kind():
    found = [f"{path.name}:{node.lineno}" for path in sorted(COMM.glob("*.py"))
             for node in ast.walk(ast.parse(path.read_text())) if _keys_a_kind(node)]
    assert not found, f"tables keyed by a collective kind's name in comm/: {found}"
