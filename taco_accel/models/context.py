"""`TPContext`: what `parallelize` did to a model (real or emulated TP), kept at ``model.taco``."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..comm.copies import SharesGroup
from ..tp.mappings import GradSumBucket
from ..tp.overlap import OverlapState
from ..tp.regions import SequenceState
from ..comm.policy import Compression
from ..tp.sites import SiteTable
from .loss import check_logits_mode
from .plan import TPPlan


@dataclass
class TPContext(SharesGroup):
    """What `parallelize` did to a model, kept at ``model.taco``.

    ``sites``: the communication sites (print it; ``save`` / ``load`` their group sizes).
    ``logits``: what ``outputs.logits`` holds (`taco_accel.models.loss`): ``"full"``
    (default: the full vocabulary, with or without labels) or ``"local"`` (this rank's
    vocabulary slice when ``labels`` are given) or ``"none"`` (no logits when ``labels`` are
    given: the head and loss fused); assignable. It is the mode of ``head``, the model's
    `models.loss.CausalLMHead` (also ``model.taco_head``).
    ``emulator``: the `EmulatedGroup` of an emulated model (``emulate=True``: ``group`` is
    None, ``rank`` 0, the logits full in both modes), None for real TP.
    ``overlap``: whether the layers hide their communication behind compute (`tp.overlap`;
    ``model.taco.overlap.enabled = False`` turns it off).
    """

    plan: TPPlan
    group: object
    tp: int
    rank: int
    compression: Compression
    sites: SiteTable
    sequence: SequenceState
    head: object = None  # the models.loss.CausalLMHead: the forward, the logits mode, the loss's kernels
    emulator: object = None
    grad_sum_params: list[str] = field(default_factory=list)
    overlap: OverlapState = field(default_factory=OverlapState)
    _grad_sum_handles: list = field(default_factory=list, repr=False)

    @property
    def sequence_parallel(self) -> bool:
        return self.sequence.enabled

    @property
    def logits(self) -> str:
        return self.head.mode

    @logits.setter
    def logits(self, mode: str) -> None:
        self.head.mode = check_logits_mode(mode)

    @property
    def emulated(self) -> bool:
        return self.emulator is not None

    def install_grad_sums(self, model: nn.Module) -> None:
        """(Re)register the gradient sums of replicated parameters that see part of the data
        (call again after replacing parameter objects, as `from_pretrained` does): one plain
        all-reduce per backward for all of them (`GradSumBucket`)."""
        self.remove_grad_sums()
        params = [p for p in map(model.get_parameter, self.grad_sum_params) if p.requires_grad]
        if params:
            self._grad_sum_handles = [GradSumBucket(params, self.sites.plain("replicated_params/grad"))]

    def remove_grad_sums(self) -> None:
        """Drop the gradient-sum hooks, for a wrapper that replaces the parameter objects (FSDP2)
        and sums ``grad_sum_params`` over the TP group itself after backward."""
        for handle in self._grad_sum_handles:
            handle.remove()
        self._grad_sum_handles = []

    def short(self, name: str) -> str:
        """Site names drop the base model prefix: ``model.layers.3.mlp`` -> ``layers.3.mlp``."""
        head = self.plan.embedding.split(".")[0] + "."
        return name[len(head):] if name.startswith(head) else name


def context_of(model: nn.Module) -> TPContext:
    ctx = getattr(model, "taco", None)
    if not isinstance(ctx, TPContext):
        raise ValueError(f"{type(model).__name__} is not parallelised; call taco_accel.parallelize(model) first")
    return ctx
