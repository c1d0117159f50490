"""The contract of each upstream name taco_accel relies on (`taco_accel.upstream`): in the installed
version it behaves as the adapter uses it (not only exists with that signature); the entry
points refuse versions outside the supported ranges, naming them, while ``import taco_accel``
and the codec work with any version. A new upstream version that breaks one fails here, by
name, instead of somewhere in a training run."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import taco_accel
from taco_accel.errors import ConfigError
from taco_accel.models.tiny import tiny_model
from taco_accel.upstream import accelerate as up_accelerate
from taco_accel.upstream import peft as up_peft
from taco_accel.upstream import torch as up_torch
from taco_accel.upstream import transformers as up_transformers
from taco_accel.upstream import trl as up_trl
from taco_accel.upstream.versions import check_range


# -- versions ---------------------------------------------------------------------------------

def test_an_unsupported_version_names_the_supported_range():
    with pytest.raises(ConfigError, match=r"torch .* is installed; .* checked against >=0.1,<0.2: install a "
                                          r"version in that range \(pip install 'torch>=0.1,<0.2'\)"):
        check_range("torch", "0.1", "0.2")
    assert check_range("no-such-package-taco", "0.1", "0.2") is None  # optional and absent: nothing to check
    for module in (up_accelerate, up_transformers, up_peft, up_trl, up_torch):  # the installed stack is supported
        assert module.check_version() is not None, module.__name__


def _installed(folder, monkeypatch, **versions: str) -> None:
    """Distribution metadata claiming ``versions`` (package -> version), found before the real
    packages' (what pip leaves behind; the imported modules stay the real ones)."""
    for package, version in versions.items():
        info = folder / f"{package}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
    monkeypatch.syspath_prepend(str(folder))


def _refusal(call) -> str:
    with pytest.raises(ConfigError) as caught:
        call()
    return str(caught.value)


# package: (a version outside the range, the range as the error names it)
OUTSIDE = {"transformers": ("5.9.0", ">=5.10,<5.26"), "accelerate": ("1.14.0", ">=1.15,<1.17"),
           "trl": ("1.17.0", ">=1.16,<1.17"), "peft": ("0.16.0", f">={up_peft.SUPPORTED[0]},<0.23")}


@pytest.mark.parametrize("package", list(OUTSIDE))
def test_entry_points_refuse_a_version_outside_the_range_and_the_codec_still_works(package, tmp_path, monkeypatch):
    from transformers import Trainer
    from trl import SFTTrainer

    version, supported = OUTSIDE[package]
    _installed(tmp_path, monkeypatch, **{package: version})
    x = torch.randn(4, 256)
    assert (taco_accel.decompress(taco_accel.compress(x)) - x).norm() < 0.1 * x.norm()  # codec-only use
    needs = {  # every entry point that needs the package, called as a user calls it
        "transformers": [lambda: taco_accel.taco_trainer(Trainer),
                         lambda: taco_accel.parallelize(tiny_model("qwen2"), tp=2, emulate=True)],
        "accelerate": [lambda: taco_accel.Accelerator(), lambda: taco_accel.taco_trainer(Trainer)],
        "trl": [lambda: taco_accel.taco_trainer(SFTTrainer)],
        "peft": [lambda: up_peft.register_custom_modules(_lora_config(), {})],  # the first use on every LoRA path
    }[package]
    for call in needs:
        message = _refusal(call)
        assert f"{package} {version} is installed" in message and f"'{package}{supported}'" in message, message
    if package == "trl":  # a Trainer that is not TRL's does not need it
        assert taco_accel.taco_trainer(Trainer).__name__ == "TacoTrainer"


def _lora_config():
    from peft import LoraConfig

    return LoraConfig(r=2, target_modules=["q_proj"])


# -- accelerate -------------------------------------------------------------------------------

def test_accelerate_keeps_its_prepared_objects_in_lists():
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2)
    model, opt, sched, loader = acc.prepare(model, opt, sched, loader)
    state = {"state_dict": lambda: {}, "load_state_dict": lambda s: None}
    acc.register_for_checkpointing(type("Custom", (), state)())
    for kind, prepared in (("optimizer", opt), ("scheduler", sched), ("dataloader", loader)):
        assert up_accelerate.prepared(acc, kind) == [prepared], kind
        assert up_accelerate.is_prepared(prepared), kind
    assert len(up_accelerate.prepared(acc, "custom")) == 1
    extra = object()
    up_accelerate.add_prepared(acc, "optimizer", extra)
    assert up_accelerate.prepared(acc, "optimizer")[-1] is extra


def test_accelerate_keeps_the_state_hooks_in_order():
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    first, second, loading = (lambda *a: None), (lambda *a: None), (lambda *a: None)
    acc.register_save_state_pre_hook(first)
    acc.register_save_state_pre_hook(second)
    acc.register_load_state_pre_hook(loading)
    assert up_accelerate.save_state_pre_hooks(acc) == [first, second]
    assert up_accelerate.load_state_pre_hooks(acc) == [loading]


def test_accelerates_split_runs_over_the_count_given():
    """`upstream.accelerate.split_between`: PartialState's split (its generator under the context
    manager) over a given count of processes, as Accelerate splits over every process: lists,
    dicts of lists, padding by the last element, a datasets Dataset."""
    from datasets import Dataset

    shares = {}
    for index in range(2):
        with up_accelerate.split_between(list("ABCDE"), 2, index, "cpu") as share:
            shares[index] = share
        with up_accelerate.split_between({"a": [1, 2, 3], "b": [4, 5, 6]}, 2, index, "cpu", apply_padding=True) as share:
            shares["dict", index] = share
        with up_accelerate.split_between(Dataset.from_list([{"x": i} for i in range(3)]), 2, index, "cpu") as share:
            shares["dataset", index] = share["x"]
    assert (shares[0], shares[1]) == (list("ABC"), list("DE"))
    assert (shares["dict", 0], shares["dict", 1]) == ({"a": [1, 2], "b": [4, 5]}, {"a": [3, 3], "b": [6, 6]})
    assert (shares["dataset", 0], shares["dataset", 1]) == ([0, 1], [2])


def test_the_replica_scheduler_steps_as_accelerates_does_once_per_replica():
    from accelerate import Accelerator
    from accelerate.scheduler import AcceleratedScheduler

    acc = Accelerator(cpu=True)  # one process: Accelerate's own wrapper steps once per optimizer step
    runs = {}
    for name, replicas in (("accelerate", None), ("replicas=1", 1), ("replicas=3", 3)):
        opt = acc.prepare_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0))
        schedule = torch.optim.lr_scheduler.LambdaLR(opt.optimizer, lambda s: 1.0 / (1 + s))
        wrapped = (AcceleratedScheduler(schedule, opt) if replicas is None
                   else up_accelerate.ReplicaScheduler(schedule, opt, replicas=replicas))
        counts = []
        for sync in (True, False, True):  # an accumulation micro-step between two optimizer steps
            acc.gradient_state._set_sync_gradients(sync)
            opt.step()
            wrapped.step()
            counts.append((schedule.last_epoch, schedule._step_count))
        acc.gradient_state._set_sync_gradients(True)
        runs[name] = counts
    assert runs["replicas=1"] == runs["accelerate"] == [(1, 2), (1, 2), (2, 3)]
    assert runs["replicas=3"] == [(3, 4), (3, 4), (6, 7)]


# -- transformers -----------------------------------------------------------------------------

def test_the_trainer_methods_a_taco_trainer_overrides():
    from transformers import Trainer

    up_transformers.check_trainer(Trainer)
    bad = type("Renamed", (Trainer,), {"_load_best_model": lambda self, path: None})
    with pytest.raises(TypeError, match=r"Renamed._load_best_model is \(self, path\), taco_trainer overrides it"):
        up_transformers.check_trainer(bad)


def test_the_trainer_builds_its_accelerator_from_its_modules_name_and_counts_tokens_through_it(tmp_path):
    from accelerate import Accelerator
    from transformers import Trainer, TrainingArguments

    original, built = up_transformers.trainer_builds_with(), []

    def factory(**kwargs):
        built.append(Accelerator(**kwargs))
        return built[-1]

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], include_num_input_tokens_seen="all")
    with up_transformers.building_accelerator(factory):
        assert up_transformers.trainer_builds_with() is factory
        trainer = Trainer(model=tiny_model("qwen2"), args=args)
    assert up_transformers.trainer_builds_with() is original
    assert built and trainer.accelerator is built[0]
    ids = torch.zeros(3, 5, dtype=torch.long)
    trainer._track_num_input_tokens({"input_ids": ids})  # adds accelerator.gather(count).sum(): one process
    assert trainer.state.num_input_tokens_seen == 15


class _Describing:
    """A Trainer's accelerator that describes ``sizes`` (an Accelerate ``ParallelismConfig``) as
    its ``parallelism_config``, everything else the wrapped one's."""

    def __init__(self, accelerator, sizes) -> None:
        self._accelerator, self.parallelism_config = accelerator, sizes

    def __getattr__(self, name):
        return getattr(self._accelerator, name)


@pytest.mark.parametrize("averaged", [False, True])
def test_the_trainer_divides_a_token_count_by_the_tp_size_its_accelerator_describes(tmp_path, averaged):
    """transformers divides a token count by the processes its accelerator's parallelism_config
    says share a batch, gathered or not (``average_tokens_across_devices``; 5.25 exactly, 5.10
    rounding down): by tp, the loss would be tp times its mean where the count is a process's own.
    The taco trainer's accelerator describes its data-parallel replicas (tp 1): the count stays
    the replicas' own, gathered or not."""
    from accelerate import ParallelismConfig
    from transformers import Trainer, TrainingArguments

    from taco_accel.integrations import sizes
    from taco_accel.parallel import ParallelDims

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                             average_tokens_across_devices=averaged)
    labels = torch.tensor([[-100, 1, 2, 3, 4, 5, -100]])  # 5 scored tokens, shifted (5.25) or not (5.10)
    counts = {}
    for name, described in (("mesh", ParallelismConfig(tp_size=2)), ("taco", sizes.describe(ParallelDims(tp=2)))):
        trainer = Trainer(model=tiny_model("qwen2"), args=args)
        trainer.accelerator = _Describing(trainer.accelerator, described)
        counts[name] = float(trainer._get_num_items_in_batch([{"labels": labels}], torch.device("cpu")))
        counts[name, "tp"] = trainer.get_tp_size()
    # one process: nothing gathered even with averaging on (world size 1)
    assert counts["mesh"] in (2.0, 2.5) and counts["taco"] == 5.0, counts
    assert counts["taco", "tp"] == 1, counts  # and so the loss scale num_processes // tp of 5.25


def test_training_arguments_set_devices_up_in_a_cached_property(tmp_path):
    from accelerate.state import PartialState
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[])
    args.use_cpu = True
    up_transformers.setup_devices_again(args)
    assert args.device.type == "cpu" and PartialState().device.type == "cpu"
    assert "_setup_devices" in args.__dict__  # computed once more, then cached as before


@pytest.mark.parametrize("sliding", [False, True])
def test_the_causal_mask_of_packed_sequences(sliding):
    config = tiny_model("qwen2", use_sliding_window=sliding, sliding_window=2, max_window_layers=0).config
    hidden = torch.zeros(1, 5, config.hidden_size)
    positions = torch.tensor([[0, 1, 2, 0, 1]])  # two packed sequences: 3 tokens, then 2
    mask = up_transformers.mask_builders()["sliding_attention" if sliding else "full_attention"](config, hidden, positions)
    allowed = (mask if mask.dtype == torch.bool else mask == 0)[0, 0].int()  # sdpa's booleans, eager's 0 / -inf
    segment = torch.tensor([0, 0, 0, 1, 1])
    q, k = torch.arange(5)[:, None], torch.arange(5)[None, :]
    expected = (segment[:, None] == segment[None, :]) & (k <= q) & ((q - k < 2) if sliding else True)
    assert allowed.tolist() == expected.int().tolist()


def test_transformers_default_causal_lm_loss_is_told_from_ones_own():
    model = tiny_model("qwen2")
    default = up_transformers.default_causal_lm_loss()
    assert model.loss_function is default and up_transformers.own_loss_function(model, default) is None
    model.loss_function = default  # set, but transformers' own
    assert up_transformers.own_loss_function(model, default) is None
    model.loss_function = own = lambda logits, labels, vocab_size, **kwargs: logits.sum()
    assert up_transformers.own_loss_function(model, default) is own


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama", "mistral", "gpt2"])
def test_a_causal_lm_forward_declares_its_output_class(arch):
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions, CausalLMOutputWithPast

    model = tiny_model(arch)
    want = CausalLMOutputWithCrossAttentions if arch == "gpt2" else CausalLMOutputWithPast
    assert up_transformers.causal_lm_output_type(type(model)) is want
    with pytest.raises(TypeError, match="not a ModelOutput with loss and logits"):
        up_transformers.causal_lm_output_type(type(model.base_model))


def test_logits_to_keep_slices_as_the_installed_transformers():
    hidden, keep = torch.arange(24.0).view(2, 4, 3), up_transformers.logits_slicer()
    assert torch.equal(keep(hidden, 0), hidden)
    assert torch.equal(keep(hidden, 1), hidden[:, -1:])
    assert torch.equal(keep(hidden, torch.tensor([0, 2])), hidden[:, [0, 2]])


def test_a_model_with_peft_adapters_says_so():
    from peft import LoraConfig
    from transformers.integrations.peft import PeftAdapterMixin

    model = tiny_model("qwen2")
    assert isinstance(model, PeftAdapterMixin) and not up_transformers.has_peft_adapters(model)
    model.add_adapter(LoraConfig(r=2, target_modules=["q_proj"]))  # transformers 5.25 asks for peft >= 0.22
    assert up_transformers.has_peft_adapters(model)


# -- peft -------------------------------------------------------------------------------------

def test_peft_registers_custom_modules_and_casts_inputs():
    from peft import LoraConfig
    from peft.tuners.lora.layer import LoraLayer

    assert list(inspect.signature(LoraConfig._register_custom_module).parameters) == ["self", "mapping"]
    config = LoraConfig(r=2, target_modules=["x"])
    up_peft.register_custom_modules(config, {torch.nn.Identity: torch.nn.Identity})
    assert config._custom_modules == {torch.nn.Identity: torch.nn.Identity}
    assert list(inspect.signature(LoraLayer._cast_input_dtype).parameters) == ["self", "x", "dtype"]


def test_a_lora_layer_takes_its_base_layers_sizes_from_the_mixin():
    from peft import LoraConfig
    from peft.tuners.lora.layer import Linear

    class Sized(torch.nn.Module):  # a layer type peft does not know, as our parallel linears
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(4, 6))
            self.in_features, self.out_features = 6, 4

        def forward(self, x):
            return x @ self.weight.T

    config = LoraConfig(r=2, lora_alpha=2, target_modules=["x"])
    with pytest.warns(UserWarning, match="Unsupported layer type"):  # peft's own reading of a type it does not know
        Linear(Sized(), "default", config=config, r=2, lora_alpha=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read through the mixin: no guess
        layer = type("Layer", (up_peft.BaseLayerSizes, Linear), {})(Sized(), "default", config=config, r=2, lora_alpha=2)
    assert (layer.in_features, layer.out_features) == (6, 4)
    assert tuple(layer.lora_A["default"].weight.shape) == (2, 6) and tuple(layer.lora_B["default"].weight.shape) == (4, 2)


# -- trl --------------------------------------------------------------------------------------

def test_trl_divides_its_token_count_by_the_tp_size_its_accelerator_describes(tmp_path):
    """TRL's SFT token count (``num_tokens``) is divided by ``_tp_size``, read from the accelerator's
    parallelism_config when the trainer is built: the taco trainer's describes its replicas (tp 1)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from taco_accel.data.tokenizer import build_tokenizer

    texts = Dataset.from_list([{"text": "tensor parallel " * (1 + i)} for i in range(4)])
    trainer = SFTTrainer(model=tiny_model("qwen2", vocab_size=257), processing_class=build_tokenizer("byte"),
                         train_dataset=texts, args=SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False,
                                                             report_to=[], per_device_train_batch_size=4,
                                                             dataset_num_proc=None))
    assert trainer._tp_size == 1  # no parallelism_config: one process
    batch = next(iter(trainer.get_train_dataloader()))
    tokens = int(batch["attention_mask"].sum())
    counted = []
    for tp_size in (2, 1):  # TRL's division by a tp size; then by the taco trainer's, 1
        trainer._tp_size = tp_size
        trainer._total_train_tokens = 0
        trainer.compute_loss(trainer.model, dict(batch))
        counted.append(trainer._total_train_tokens)
    assert counted == [tokens // 2, tokens]
    assert "self._tp_size = self.accelerator.parallelism_config.tp_size" in inspect.getsource(SFTTrainer.__init__)


def test_trl_trainers_outside_the_checked_ones_are_refused_in_one_line():
    import trl
    from trl.experimental.online_dpo import OnlineDPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    for name in up_trl.CHECKED_TRAINERS:  # each trains against one process in test_hf_trainer / test_entry_matrix
        cls = getattr(trl, name)
        assert taco_accel.taco_trainer(cls).__name__ == f"Taco{name}"
        assert taco_accel.taco_trainer(type("Mine", (cls,), {})).__name__ == "TacoMine"  # a user's subclass
    for cls in (ORPOTrainer, OnlineDPOTrainer, trl.DistillationTrainer, trl.RewardTrainer):
        with pytest.raises(ValueError) as refused:
            taco_accel.taco_trainer(cls)
        message = str(refused.value)
        assert f"{cls.__name__} is not checked with taco_accel" in message and "\n" not in message, message
        assert "GRPOTrainer" in message and "without taco_trainer" in message, message


def test_trl_online_trainers_gather_with_the_module_names_taco_trainer_swaps():
    import accelerate.utils
    import trl
    from trl.trainer import grpo_trainer, rloo_trainer

    mine = type("Mine", (trl.GRPOTrainer,), {})
    assert up_trl.online_trainer(mine) is trl.GRPOTrainer and up_trl.online_trainer(trl.RLOOTrainer) is trl.RLOOTrainer
    assert up_trl.online_trainer(trl.SFTTrainer) is None and up_trl.online_trainer(trl.KTOTrainer) is None
    for module in (grpo_trainer, rloo_trainer):  # the names TRL calls when it gathers rewards and logs
        assert module.gather is accelerate.utils.gather and module.gather_object is accelerate.utils.gather_object
        assert "gather(rewards_per_func)" in inspect.getsource(module)
    with up_trl.gathering_with(up_trl.online_trainer(mine), len, sorted):
        assert grpo_trainer.gather is len and grpo_trainer.gather_object is sorted
        assert rloo_trainer.gather is accelerate.utils.gather  # another trainer's module is left alone
    assert grpo_trainer.gather is accelerate.utils.gather and grpo_trainer.gather_object is accelerate.utils.gather_object


def test_trl_fused_head_takes_the_keyword_and_holds_its_settings():
    from trl.trainer.utils import FusedCausalLMOutput, add_fused_lm_head

    model = tiny_model("qwen2")
    assert not up_trl.has_fused_head(model.__dict__.get("forward"))
    assert up_trl.fused_head_settings(model.__dict__.get("forward")) is None
    original = model.forward
    add_fused_lm_head(model, temperature=0.5, outputs=("log_probs", "entropy"))
    assert up_trl.has_fused_head(model.__dict__.get("forward"))
    settings = up_trl.fused_head_settings(model.__dict__.get("forward"))
    assert (settings.temperature, settings.logit_scale, settings.final_logit_softcapping) == (0.5, 1.0, None)
    assert settings.outputs == ("log_probs", "entropy") and not settings.cast_lm_head_to_fp32
    assert settings.original_forward == original and settings.output_type is FusedCausalLMOutput


def _group_stores() -> dict:
    import torch.distributed as dist

    from taco_accel.upstream.torch import group_store

    group = dist.new_group([0, 1])
    out = {}
    for name, g in (("default", None), ("group", group)):
        store = group_store(g)
        store.set(f"note{dist.get_rank()}", name)
        store.wait([f"note{1 - dist.get_rank()}"])
        out[name] = store.get(f"note{1 - dist.get_rank()}").decode()
    return out


def test_a_process_groups_store_passes_notes_between_its_ranks():
    """`upstream.torch.group_store`: the store a group was made with, where each rank reads what
    another wrote (the default group's and a new group's, each with keys of its own)."""
    from harness import run_ranks

    assert up_torch.check_version() is not None
    assert run_ranks(_group_stores, 2) == [{"default": "default", "group": "group"}] * 2
