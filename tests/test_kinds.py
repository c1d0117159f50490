"""`comm.kinds.KINDS` is the one source of what the code knows per collective kind: every kind the
collectives issue is registered there, the agreement codes, the statistics' plain bytes, the
custom ops and the result shapes answer from it, and no other module of comm keys a table by a
kind's name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from taco_accel.comm import agreement, collectives, ops
from taco_accel.comm.emulated import EmulatedGroup
from taco_accel.comm.kinds import KINDS, kind_of
from taco_accel.comm.stats import DEFAULT

COMM = Path(collectives.__file__).parent
PUBLIC = ("all_reduce", "reduce_scatter", "all_gather")


def test_every_kind_issued_is_registered_and_an_unknown_one_is_refused():
    issued = {*PUBLIC, collectives.GatherByRank.kind, collectives.ScatterByRank.kind}
    assert issued == set(KINDS)
    assert all(KINDS[name].name == name for name in KINDS)
    with pytest.raises(ValueError, match="unknown collective 'all_to_all'"):
        kind_of("all_to_all")


def test_agreement_codes_stats_bytes_ops_and_shapes_answer_from_the_registry():
    assert agreement.KINDS == (*KINDS, "send")  # the fingerprint's code: the index in the registry
    for name in PUBLIC:  # a custom op for every kind a compiled TP graph issues
        assert KINDS[name].op is not None and hasattr(torch.ops.taco, name)
    world, group = 3, EmulatedGroup(3)
    xs = [torch.randn(world * 2, 5, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    nbytes = xs[0].numel() * xs[0].element_size()
    for name in PUBLIC:
        out = getattr(group, name)(xs, site=f"kinds.{name}")  # plain: no codec
        shape = out[0].shape if name == "reduce_scatter" else out.shape  # reduce_scatter: one tensor per rank
        assert tuple(shape) == KINDS[name].output_shape(xs[0].shape, world)
        figures = DEFAULT.pop()[f"kinds.{name}"]
        # exact integer ring figures: the plain call sends what the kind's plain_bytes says, on both counts
        assert figures.bytes_sent == figures.bytes_uncompressed == KINDS[name].plain_bytes(nbytes, world)
    assert ops.all_gather is KINDS["all_gather"].op and ops.reduce_scatter is KINDS["reduce_scatter"].op


def _keys_a_kind(node: ast.AST) -> bool:
    """A dict literal keyed by a kind's name, or a tuple / set of kind names (an ``in`` test)."""
    if isinstance(node, ast.Dict):
        names = [k.value for k in node.keys if isinstance(k, ast.Constant)]
    elif isinstance(node, (ast.Tuple, ast.Set)):
        names = [e.value for e in node.elts if isinstance(e, ast.Constant)]
    else:
        return False
    return sum(isinstance(n, str) and n in KINDS for n in names) >= (1 if isinstance(node, ast.Dict) else 2)


def test_no_other_comm_module_keys_a_table_by_kind():
    allowed = {"kinds.py", "__init__.py"}  # __init__: the public names of the package
    found = [f"{path.name}:{node.lineno}" for path in sorted(COMM.glob("*.py")) if path.name not in allowed
             for node in ast.walk(ast.parse(path.read_text())) if _keys_a_kind(node)]
    assert not found, f"tables keyed by a collective kind outside comm/kinds.py: {found}"
