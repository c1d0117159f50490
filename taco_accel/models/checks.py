"""Checks that turn silently wrong numbers into errors, for `parallelize` and the models it makes.

- What `parallelize` takes (`check_call`): a plain transformers causal LM, not a peft,
  quantized, DDP/FSDP-wrapped or already DTensor-sharded one; no unknown ``nn.Linear`` /
  ``nn.Embedding`` subclasses where the plan swaps modules (their own forward would be lost);
  argument values, with the valid ones named.
- The same model on every TP rank (`verify_same_model`): a fingerprint of the config and of
  every parameter (name, shape, dtype, a checksum of a sample of its values) exchanged once
  over the TP group. Ranks that built different models would otherwise train a chimera.
- Inputs of every forward (`InputIdsCheck`, `check_labels`): token ids and labels outside
  the vocabulary raise, as in plain transformers (a vocab-parallel embedding would look an
  id up as zeros, and the vocab-parallel loss would score a label against no logit). The
  first forward also checks that every TP rank got the same ``input_ids``, and a later one
  whose ids have a shape not seen before that every rank got that shape (their collectives
  would otherwise disagree in size, which gloo answers by aborting the process); a shape once
  agreed is not exchanged again, unless ``TACO_CHECK_COLLECTIVES=1`` asks for every forward.

A check whose outcome could differ between ranks (the model, the first batch) decides after
one collective that every rank of the group takes part in, so that all of them raise the same
error instead of some hanging; the range checks need none, as every TP rank gets the same ids
and labels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..comm import agreement
from ..comm.agreement import debug as check_every_call
from ..comm.copies import SharesGroup
from ..upstream.transformers import has_peft_adapters
from .plan import Colwise, Rowwise, TPPlan

QUANTIZER_PACKAGES = ("bitsandbytes", "optimum.quanto", "quanto", "torchao", "auto_gptq", "gptqmodel", "awq", "hqq")
# config entries that say how a process runs the model or where it came from, not what it
# computes (transformers' save_pretrained sets ``architectures`` and ``dtype`` on the writing
# rank only; parameter dtypes are compared directly)
CONFIG_NOT_COMPARED = frozenset({
    "_name_or_path", "_commit_hash", "transformers_version", "use_cache", "return_dict",
    "output_hidden_states", "output_attentions", "architectures", "dtype", "torch_dtype", "id2label", "label2id",
    "problem_type", "finetuning_task", "tokenizer_class", "prefix", "task_specific_params",
})
SAMPLE = 4096  # values per parameter in the fingerprint's checksum


# -- what parallelize takes -----------------------------------------------------------------

def check_model_kind(model: nn.Module) -> None:
    """A ValueError for models `parallelize` must not rewrite: wrapped, peft, quantized, or
    tensor-parallel already. Run before `plan_for` (a PeftModel forwards ``config`` to its
    base model, so the plan lookup would succeed and fail later, obscurely)."""
    kind = type(model).__name__
    if isinstance(getattr(model, "module", None), nn.Module) and kind in (
        "DistributedDataParallel", "DataParallel", "FullyShardedDataParallel"
    ):
        raise ValueError(f"parallelize got a {kind}; parallelize the transformers model first, then wrap it")
    if _from_package(type(model), "peft") or has_peft_adapters(model) or any(
        _from_package(type(m), "peft") for m in model.modules()
    ):
        raise ValueError(
            f"parallelize got a peft model ({kind} with LoRA layers): peft's layers would skip the TP "
            "collectives. Parallelise the transformers model first, then add the adapters: "
            "model = taco_accel.get_peft_model(taco_accel.parallelize(model), lora_config)"
        )
    quantized = _quantization(model)
    if quantized:
        raise ValueError(
            f"parallelize does not take quantized models ({quantized}): the parallel layers hold plain "
            "floating-point weights. Load the model without quantization (no quantization_config, "
            "load_in_8bit or load_in_4bit), e.g. with dtype=torch.bfloat16"
        )
    sharded = next((n for n, p in model.named_parameters() if hasattr(p, "placements")), None)
    if sharded is not None:
        raise ValueError(
            f"parallelize got a model whose parameters are DTensors ({sharded}): it is sharded already "
            "(transformers' tp_plan, or FSDP2's fully_shard). Parallelise the model as loaded, before any "
            "other sharding: load it without tp_plan, or with taco_accel.from_pretrained"
        )


def _from_package(cls: type, *packages: str) -> bool:
    """Whether ``cls`` or a base class of it is defined in one of ``packages``."""
    return any(
        k.__module__ == p or k.__module__.startswith(p + ".") for k in cls.__mro__ for p in packages
    )


def _quantization(model: nn.Module) -> str | None:
    """What makes ``model`` quantized, in words, or None."""
    config = getattr(model, "config", None)
    qconfig = getattr(config, "quantization_config", None)
    if getattr(model, "hf_quantizer", None) is not None or qconfig is not None:
        method = qconfig.get("quant_method") if isinstance(qconfig, dict) else getattr(qconfig, "quant_method", None)
        return f"quant_method={method!r}" if method is not None else "model.is_quantized"
    for name, module in model.named_modules():
        if _from_package(type(module), *QUANTIZER_PACKAGES):
            return f"{name} is a {type(module).__module__}.{type(module).__name__}"
    for name, param in model.named_parameters():
        if not param.is_floating_point() or param.element_size() == 1:
            return f"{name} has dtype {param.dtype}"
        if type(param) not in (nn.Parameter, torch.Tensor) and not hasattr(param, "placements"):
            return f"{name} is a {type(param).__name__}"
    return None


def check_modules(model: nn.Module, plan: TPPlan) -> None:
    """A ValueError for a module the plan replaces that is not a plain ``nn.Linear``,
    transformers ``Conv1D`` or ``nn.Embedding``: the parallel layer reimplements only their
    forward, so a subclass's own forward (or its extra parameters) would silently vanish."""
    swapped = [(plan.embedding, nn.Embedding), (plan.lm_head, nn.Linear)]
    for index in range(len(model.get_submodule(plan.layers))):
        swapped += [
            (f"{plan.layers}.{index}.{rel}", nn.Linear)
            for rel, style in plan.layer.items() if isinstance(style, (Colwise, Rowwise))
        ]
    for name, base in swapped:
        module = model.get_submodule(name)
        cls = type(module)
        hooks = _hooks(module, keep_forward_hooks=name == plan.embedding)  # rewrite.carry_forward_hooks
        if hooks:
            raise ValueError(
                f"{name} has {', '.join(hooks)}; parallelize replaces this module by a parallel layer and would drop "
                "them. Register them after parallelize, on the new module (it holds and computes this rank's "
                "shard), or remove them"
            )
        if cls is base or (cls.__name__ == "Conv1D" and _from_package(cls, "transformers")):
            continue
        if not isinstance(module, base):
            raise ValueError(
                f"{name} is a {cls.__module__}.{cls.__name__}; the {plan.name} plan makes it parallel "
                f"and takes a plain {base.__module__}.{base.__name__} there"
            )
        extra = sorted(set(dict(module.named_parameters()).keys() | dict(module.named_buffers()).keys())
                       - {"weight", "bias"})
        if cls.forward is not base.forward or extra:
            what = f"its parameters or buffers {extra}" if extra else "its own forward"
            raise ValueError(
                f"{name} is a {cls.__module__}.{cls.__name__}, a subclass of {base.__name__} that "
                f"parallelize does not know: it would become a plain parallel layer and lose {what}. "
                f"Use {base.__name__} there (apply the change after parallelize, e.g. as a forward hook)"
            )


def _hooks(module: nn.Module, keep_forward_hooks: bool = False) -> list[str]:
    """The hooks and instance-level forward of ``module`` that replacing it would lose, in words
    (its forward hooks not, with ``keep_forward_hooks``: the replacement takes them over)."""
    kinds = {"_backward_pre_hooks": "backward pre-hooks", "_backward_hooks": "backward hooks"}
    if not keep_forward_hooks:
        kinds = {"_forward_pre_hooks": "forward pre-hooks", "_forward_hooks": "forward hooks", **kinds}
    found = [f"{what} ({', '.join(getattr(h, '__name__', type(h).__name__) for h in getattr(module, attr).values())})"
             for attr, what in kinds.items() if getattr(module, attr, None)]
    if "forward" in vars(module):
        found.append("a forward of its own (e.g. an accelerate hook)")
    return found


def check_arguments(model: nn.Module, plan: TPPlan, tp, sequence_parallel, device_mesh, emulate, verify) -> None:
    """ValueErrors quoting bad argument values and naming the valid ones."""
    for name, value in (("sequence_parallel", sequence_parallel), ("emulate", emulate), ("verify", verify)):
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r}: pass True or False")
    if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
        heads = plan.dims(model.config).num_heads
        valid = [d for d in range(1, heads + 1) if heads % d == 0]
        default = "" if emulate else ", or None (the size of device_mesh's tp group, else the world size)"
        raise ValueError(
            f"tp={tp!r}: pass an int that divides num_attention_heads={heads}, one of {valid}{default}"
        )
    if device_mesh is not None and not isinstance(device_mesh, dist.ProcessGroup) and not (
        hasattr(device_mesh, "get_group") and hasattr(device_mesh, "ndim")
    ):
        raise ValueError(
            f"device_mesh={device_mesh!r}: pass None, a torch DeviceMesh (1-D, or with a 'tp' dim) "
            "or a torch.distributed ProcessGroup"
        )


def check_call(model: nn.Module, tp, sequence_parallel, device_mesh, emulate, verify) -> TPPlan:
    """Every check `parallelize` runs before it looks at process groups; returns the plan."""
    from .plan import plan_for

    check_model_kind(model)
    plan = plan_for(model)
    check_arguments(model, plan, tp, sequence_parallel, device_mesh, emulate, verify)
    check_modules(model, plan)
    if plan.check is not None:
        plan.check(model.config)
    return plan


# -- the same model on every rank -----------------------------------------------------------

def fingerprint(model: nn.Module) -> dict:
    """``{"config": {...}, "params": [(name, shape, dtype, requires_grad, checksum)]}``.

    The checksum reads ``SAMPLE`` values of each parameter at an even stride (coprime with
    its last dimension, so the sample crosses columns as well as rows) and sums their bit
    patterns as integers, plainly and weighted by position: exact and order-independent, so
    equal weights give equal sums on any device, NaNs included, and a permuted or
    transposed copy gives different ones. Parameters on the meta device (no values yet,
    as in `taco_accel.from_pretrained`) have checksum None.
    """
    config = getattr(model, "config", None)
    config = config.to_dict() if hasattr(config, "to_dict") else {}
    params, sums = [], []
    for name, param in model.named_parameters():
        params.append([name, tuple(param.shape), str(param.dtype), param.requires_grad, None])
        if param.device.type != "meta" and param.numel():
            sums.append((len(params) - 1, _checksum(param.detach())))
    if sums:
        values = torch.stack([s.to(sums[0][1].device) for _, s in sums]).tolist()
        for (i, _), value in zip(sums, values):
            params[i][4] = tuple(value)
    return {
        "config": {k: v for k, v in sorted(config.items()) if k not in CONFIG_NOT_COMPARED},
        "params": [tuple(p) for p in params],
    }


def _checksum(tensor: torch.Tensor) -> torch.Tensor:
    """(2,) int64: the sum and the position-weighted sum of a strided sample's bit patterns."""
    flat = tensor.reshape(-1)
    stride = max(1, flat.numel() // SAMPLE)
    last = tensor.shape[-1] if tensor.dim() else 1
    while stride > 1 and _gcd(stride, last) != 1:
        stride += 1
    sample = flat[::stride][:SAMPLE].contiguous()
    size = sample.element_size()
    bits = sample.view({1: torch.int8, 2: torch.int16}.get(size, torch.int32)).long()  # 8 bytes: two int32 each
    weights = torch.arange(1, bits.numel() + 1, device=bits.device)
    return torch.stack([bits.sum(), (bits * weights).sum()])


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def verify_same_model(model: nn.Module, group) -> None:
    """Compare this rank's `fingerprint` with every other rank's of ``group`` (one all-gather
    of a few KB); on a difference every rank raises the same ValueError naming the first
    differing config field or parameter."""
    size = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if size == 1:
        return
    mine = fingerprint(model)
    every = [None] * size
    dist.all_gather_object(every, mine, group=group)
    for rank, theirs in enumerate(every[1:], start=1):
        difference = _first_difference(every[0], theirs)
        if difference is not None:
            differing = [r for r in range(1, size) if every[r] != every[0]]
            raise ValueError(
                f"the TP ranks hold different models: {difference} differs between rank 0 and rank {rank} "
                f"of the tp group (ranks differing from rank 0: {differing}). Tensor parallelism splits one "
                "model over the ranks, so every rank must start from the same one: set the same seed before "
                "building it (torch.manual_seed) or load the same checkpoint on every rank "
                "(taco_accel.from_pretrained reads only each rank's slices). verify=False skips this check"
            )


def _first_difference(ours: dict, theirs: dict) -> str | None:
    a, b = ours["config"], theirs["config"]
    for key in sorted(a.keys() | b.keys()):
        if a.get(key, "<missing>") != b.get(key, "<missing>"):
            return f"config.{key} ({a.get(key, '<missing>')!r} vs {b.get(key, '<missing>')!r})"
    names_a, names_b = [p[0] for p in ours["params"]], [p[0] for p in theirs["params"]]
    if names_a != names_b:
        name = next((x for x, y in zip(names_a, names_b) if x != y), None)
        name = name or (names_a[len(names_b)] if len(names_a) > len(names_b) else names_b[len(names_a)])
        return f"the parameter list (first at {name!r})"
    for (name, *meta_a, sum_a), (_, *meta_b, sum_b) in zip(ours["params"], theirs["params"]):
        if meta_a != meta_b:
            return f"parameter {name} (shape, dtype, requires_grad: {tuple(meta_a)} vs {tuple(meta_b)})"
        if sum_a != sum_b:
            return f"the values of parameter {name}"
    return None


# -- inputs ---------------------------------------------------------------------------------

def _out_of_range(values: torch.Tensor, limit: int, what: str, ignore_index: int | None = None) -> None:
    """Raise an IndexError when ``values`` hold one outside [0, limit) (``ignore_index`` apart).

    Cost: one min/max pass over the values (b*s integers, nothing next to the model) and no host
    read (`assert_on_device`).
    """
    if values.numel() == 0 or values.device.type == "meta":
        return
    if ignore_index is not None:
        values = values.masked_fill(values == ignore_index, 0)
    low, high = torch.aminmax(values)

    def error() -> IndexError:
        bad = int(low) if int(low) < 0 else int(high)
        allowed = "" if ignore_index is None else f" (or {ignore_index}, ignored)"
        return IndexError(f"{what} {bad} is out of range: the vocabulary has {limit} tokens, 0..{limit - 1}{allowed}")

    assert_on_device((low >= 0) & (high < limit), f"{what} outside [0, {limit})", error)


def assert_on_device(ok: torch.Tensor, message: str, error: Callable[[], Exception]) -> None:
    """Fail where the 0-d bool ``ok`` is False, without making the host wait: an asynchronous
    device assertion (``torch._assert_async``, saying ``message``) that surfaces at the next
    synchronisation, as plain ``nn.Embedding`` does on CUDA, and inside a compiled graph. On the
    CPU the assertion fails at once and ``error()`` is raised instead (it may read values: it runs
    only on failure). The same code on every device: a step's host reads are those of an accelerator."""
    if torch.compiler.is_compiling() or ok.device.type != "cpu":
        torch._assert_async(ok, message)
        return
    try:
        torch._assert_async(ok, message)
    except RuntimeError:
        raise error() from None


def check_labels(labels: torch.Tensor, logits: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """Shifted labels (b, s) against the logits (b, s, V or V/tp): shapes and range.

    The vocab-parallel loss scores a label on the rank that holds its row; a label outside
    the vocabulary has no row, so it would count as a logit of 0: an IndexError here, as
    ``F.cross_entropy`` raises. Every TP rank sees the same labels, so all of them raise.
    """
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels of shape {list(labels.shape)} do not match the logits {list(logits.shape[:-1])} (batch, "
            "sequence): pass labels shaped like input_ids"
        )
    _out_of_range(labels, vocab_size, "label", ignore_index)


class InputIdsCheck(SharesGroup):
    """Forward pre-hook on the vocab-parallel embedding: ids outside the vocabulary raise an
    IndexError (as ``nn.Embedding`` does) instead of being looked up as zeros; the first
    ``same_batch_checks`` calls check that every TP rank got the same ids (one all-gather of
    five numbers; ranks with different batches, e.g. a data loader sharded over the tp ranks,
    would mix the embeddings of different tokens), and a later call whose ids have a (batch,
    sequence) shape this hook has not checked before (``same_shape``), that every rank got ids
    of that shape (one all-gather of two numbers: a rank with a batch of another size would
    send collectives of another size, which gloo answers by aborting the process and NCCL by
    hanging).

    A shape checked once is not exchanged again: a training run pays one all-gather per batch
    shape, not one per forward. Ranks that later get different shapes are caught where the shape
    is new on every rank (an uneven last batch). Where it is new on some ranks only, those check it
    while the others, whose shape was agreed before, go on to the model's collectives: both wait
    until the group's timeout, and then every rank raises the same ValueError naming each rank's
    shape (each forward notes its shape, `comm.agreement.note_input`, which the timed-out ranks
    compare through the group's store). Where every rank's shape was agreed before, the TP
    collectives of different sizes are left to the backend, as any collective whose length changes
    after its first call is (`taco_accel.comm.agreement`; gloo aborts the process):
    ``TACO_CHECK_COLLECTIVES=1`` checks the shape on every forward, and then every rank raises.

    Every TP rank sees the same ids, so a local range check makes them all raise. The range
    check costs one min/max pass over the ids and no host read (`assert_on_device`); so does the
    shape check.
    """

    def __init__(self, num_embeddings: int, group, same_batch_checks: int = 1, same_shape: bool = True) -> None:
        self.num_embeddings, self.group, self.same_batch_checks = num_embeddings, group, same_batch_checks
        self.same_shape = same_shape
        self.agreed: set[tuple[int, int]] = set()  # (batch, sequence) shapes every rank was checked to have

    def __call__(self, module: nn.Module, args, kwargs) -> None:
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("input"))
        if not torch.is_tensor(ids):
            return
        weight = getattr(module, "weight", None)
        if weight is not None and weight.is_meta and ids.device.type != "meta":  # meta ids: tracing shapes
            raise ValueError(
                "the model's parameters are on the meta device: they have shapes but no values (a model built "
                "under init_empty_weights or torch.device('meta')). Load the weights first: "
                "taco_accel.from_pretrained(path, tp=...) reads them straight into the shards"
            )
        check_not_under_ddp(self.group)  # before any collective: every rank raises alone
        if not torch.compiler.is_compiling():  # a compiled graph keeps no count and no shapes
            if self.same_shape and self._size() > 1:
                agreement.note_input(self.group, _leading_shape(ids), _shapes_differ_after_timeout)
            if self.same_batch_checks > 0:
                self.same_batch_checks -= 1
                self.check_same_batch(ids)  # first: a collective every rank reaches
            elif self.same_shape and (_leading_shape(ids) not in self.agreed or check_every_call()):
                self.check_same_shape(ids)
        _out_of_range(ids, self.num_embeddings, "input id")

    def _size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_available() and dist.is_initialized() else 1

    def check_same_shape(self, ids: torch.Tensor) -> None:
        size = self._size()
        if size == 1 or ids.device.type == "meta" or torch.compiler.is_compiling():
            return
        mine = torch.empty(2, dtype=torch.long, device=ids.device)
        mine[0], mine[1] = _leading_shape(ids)  # fills: no copy, no host sync
        every = [torch.empty_like(mine) for _ in range(size)]
        with agreement.named_timeouts("input_ids", "the check that every tp rank got input_ids of one shape",
                                      self.group):  # peers that agreed on their shape before never join it
            dist.all_gather(every, mine, group=self.group)

        def error() -> ValueError:
            shapes = [t.tolist() for t in every]
            return ValueError(f"the TP ranks got input_ids of different shapes ({shapes}, by rank of the tp group). "
                              f"{SAME_BATCH_FIX}")

        assert_on_device(torch.stack(every).eq(mine).all(), "the TP ranks got input_ids of different shapes", error)
        self.agreed.add(_leading_shape(ids))  # on an accelerator a difference fails the next synchronisation

    def check_same_batch(self, ids: torch.Tensor) -> None:
        size = self._size()
        if size == 1 or ids.device.type == "meta" or torch.compiler.is_compiling():
            return
        flat = ids.reshape(-1).long()
        weights = torch.arange(1, flat.numel() + 1, device=flat.device)
        mine = torch.cat([torch.tensor(_leading_shape(ids), device=flat.device), flat.sum()[None],
                          (flat * weights).sum()[None], torch.tensor([flat.numel()], device=flat.device)])
        every = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(every, mine, group=self.group)
        every = [t.tolist() for t in every]
        differing = [r for r in range(1, size) if every[r] != every[0]]
        if differing:
            raise ValueError(
                f"the TP ranks got different input_ids (ranks {differing} of the tp group differ from rank 0: "
                f"shapes {[e[:2] for e in every]}). Every rank of a TP group must get the same batch: shard "
                "the data over the data-parallel ranks only (with Accelerate: `from taco_accel import "
                "Accelerator`, whose prepare() does; else a DistributedSampler with the dp rank and size, "
                "not the global ones)"
            )
        self.agreed.add(_leading_shape(ids))


SAME_BATCH_FIX = ("Every rank of a TP group must get the same batch: shard the data over the data-parallel ranks "
                  "only (with Accelerate: `from taco_accel import Accelerator`), and give every rank the same batch "
                  "size and sequence length (drop or pad an uneven last batch on all ranks alike)")


def _shapes_differ_after_timeout(shapes: dict[int, tuple], timed_out: str) -> str:
    """The error of TP ranks whose input_ids' shapes differed where some of them had agreed on
    theirs before (`InputIdsCheck`): found when a collective of theirs timed out."""
    shown = {rank: list(shape) for rank, shape in shapes.items()}
    return (f"the TP ranks got input_ids of different shapes ({shown}: (batch, sequence) by global rank), found when "
            f"{timed_out}: the ranks that had seen their shape before went on to the model's collectives while the "
            f"others checked theirs, and each waited for the other. {SAME_BATCH_FIX}")


def _leading_shape(ids: torch.Tensor) -> tuple[int, int]:
    """(batch, sequence) of ``ids``; 1 for a dimension it does not have."""
    return tuple(ids.shape[:2]) + (1,) * (2 - min(ids.dim(), 2))


def check_not_under_ddp(group) -> None:
    """Raise if this forward runs inside a torch DistributedDataParallel whose group holds two
    or more ranks of the TP ``group`` (what ``accelerate.Accelerator().prepare`` builds around any
    model on several processes): its construction broadcast one rank's weight shards over the
    others', and its gradient averaging would mix different shards. One attribute read when no
    DDP is active."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel._get_active_ddp_module()
    if ddp is None or group is None or torch.compiler.is_compiling():
        return
    shared = set(dist.get_process_group_ranks(ddp.process_group)) & set(dist.get_process_group_ranks(group))
    if len(shared) > 1:
        raise ValueError(
            f"this tensor-parallel model runs inside DistributedDataParallel over ranks that hold different "
            f"tensor-parallel shards (tp ranks {sorted(shared)}): DDP overwrote their weights with rank "
            f"{min(shared)}'s and would average different shards. Use `from taco_accel import Accelerator` "
            "instead of accelerate's (it lays the model out over tp and averages gradients over dp only; with "
            "transformers' Trainer or TRL's: taco_accel.taco_trainer(Trainer)(model=..., args=...), which builds "
            "it), or wrap in DDP over the data-parallel group only"
        )


def install_input_checks(model: nn.Module, plan: TPPlan, group, same_batch: bool) -> None:
    """Hook `InputIdsCheck` on the parallel embedding of ``model`` (``same_batch``: also
    compare the first batch, and the shape of every later one, over the group)."""
    embedding = model.get_submodule(plan.embedding)
    hook = InputIdsCheck(embedding.num_embeddings, group, int(same_batch), same_shape=same_batch)
    embedding.register_forward_pre_hook(hook, with_kwargs=True)
    if plan.position_embedding is not None:  # learned positions (GPT-2): a longer sequence names the limit
        positions = model.get_submodule(plan.position_embedding)
        positions.register_forward_pre_hook(PositionsCheck(positions.num_embeddings))


class PositionsCheck:
    """Forward pre-hook on a learned position embedding: a sequence longer than the model's
    positions raises an IndexError that names the limit and the fix (``nn.Embedding`` says only
    "index out of range in self" on the CPU, and asserts on the device). Its cost is
    `_out_of_range`'s: one min/max pass over the position ids."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def __call__(self, module: nn.Module, args) -> None:
        ids = args[0] if args else None
        if not torch.is_tensor(ids) or ids.numel() == 0 or ids.device.type == "meta":
            return
        high = ids.max()
        message = (f"the model has {self.limit} learned positions (config n_positions / max_position_embeddings): "
                   f"a sequence (with its cache) may hold at most {self.limit} tokens; truncate the inputs "
                   f"(tokenizer max_length={self.limit}) or split longer texts")
        assert_on_device(high < self.limit, message, lambda: IndexError(f"position {int(high)} is out of range: "
                                                                          + message))
