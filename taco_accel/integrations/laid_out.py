"""The models a `taco_accel.Accelerator` laid out on its mesh, in the order it prepared them, each
with its `ModelParts`: what the gradient reduction, clipping, communication figures and
checkpoints of the accelerator act on; and the parameters that laying out replaced by their
shards, which an optimizer built before ``prepare`` would still hold."""

from __future__ import annotations

import weakref

from torch import nn

from ..parallel import ModelParts


class LaidOutModels:
    """The laid-out models of one accelerator (`add` each after `distribute`)."""

    def __init__(self):
        self._entries: list[tuple[nn.Module, ModelParts]] = []
        self._replaced: dict[int, weakref.ref] = {}  # id -> the parameter laying out replaced

    def add(self, model: nn.Module, parts: ModelParts, before: dict[str, nn.Parameter]) -> dict[int, nn.Parameter]:
        """Keep ``model`` and its ``parts``; ``before``: its named parameters before laying out.
        Returns the parameter that now stands for each replaced one of the same name, by the old
        one's id (for the optimizers of the same ``prepare`` call)."""
        after = dict(model.named_parameters())
        now = {id(p) for p in after.values()}
        self._replaced.update({id(p): weakref.ref(p) for p in before.values() if id(p) not in now})
        self._entries.append((model, parts))
        return {id(p): after[n] for n, p in before.items() if n in after and after[n] is not p}

    @property
    def models(self) -> list[nn.Module]:
        return [model for model, _ in self._entries]

    @property
    def parts(self) -> list[ModelParts]:
        return [parts for _, parts in self._entries]

    def parts_of(self, model: nn.Module) -> ModelParts | None:
        """The parts of ``model`` (or of the model torch.compile wrapped), None if not laid out here."""
        model = getattr(model, "_orig_mod", model)
        return next((parts for m, parts in self._entries if m is model), None)

    def replaced_in(self, optimizer) -> int:
        """How many of ``optimizer``'s parameters laying out replaced by their shards."""
        return sum(1 for group in optimizer.param_groups for p in group["params"]
                   if (ref := self._replaced.get(id(p))) is not None and ref() is p)

    def finish_gradients(self) -> None:
        for parts in self.parts:
            parts.finish_gradients()

    def step_done(self) -> None:
        for parts in self.parts:
            parts.step_done()

    def owners_of(self, params: list[nn.Parameter]) -> list[ModelParts]:
        """The parts that hold any of ``params``; a ValueError if one of ``params`` belongs to
        none of them (a model the accelerator did not prepare)."""
        chosen = {id(p) for p in params}
        owners = [parts for parts in self.parts if any(id(p) in chosen for p in parts.parameters())]
        known = {id(p) for parts in owners for p in parts.parameters()}
        stray = [p for p in params if id(p) not in known]
        if stray:
            raise ValueError(
                f"clip_grad_norm_ got {len(stray)} parameter(s) of no model prepared by this accelerator; pass "
                "model.parameters() of the prepared model"
            )
        return owners

    def ledgers(self, model: nn.Module | None = None) -> list:
        """The statistics ledgers of ``model``'s communication sites (None: of every model), each
        once; a ValueError for a model the accelerator did not prepare."""
        chosen = self.parts if model is None else [self.parts_of(model)]
        if None in chosen:
            raise ValueError("compression_stats(model=...): this model was not prepared by this Accelerator; pass "
                             "the model that accelerator.prepare returned, or no model (every prepared one)")
        ledgers = []
        for parts in chosen:
            ledgers += [ledger for ledger in parts.ledgers() if all(ledger is not seen for seen in ledgers)]
        return ledgers
