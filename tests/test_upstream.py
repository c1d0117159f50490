"""The contract of each upstream private name taco_accel relies on (`taco_accel.upstream`): it
exists in the installed version, with the shape or signature the adapter uses. A new upstream
version that breaks one fails here, by name, instead of somewhere in a training run."""

from __future__ import annotations

import inspect

import pytest
import torch

from taco_accel.errors import ConfigError
from taco_accel.upstream import accelerate as up_accelerate
from taco_accel.upstream import peft as up_peft
from taco_accel.upstream import transformers as up_transformers
from taco_accel.upstream import trl as up_trl
from taco_accel.upstream.versions import check_range


def test_an_unsupported_version_names_the_supported_range():
    with pytest.raises(ConfigError, match=r"torch .* is installed; .* checked against >=0.1,<0.2: install a "
                                          r"version in that range \(pip install 'torch>=0.1,<0.2'\)"):
        check_range("torch", "0.1", "0.2")
    assert check_range("no-such-package-taco", "0.1", "0.2") is None  # optional and absent: nothing to check
    for module in (up_accelerate, up_transformers):
        assert module.VERSION is not None  # checked at import: the installed one is supported
    assert up_peft.check_version() and up_trl.check_version()


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


# -- transformers -----------------------------------------------------------------------------

def test_the_trainer_methods_a_taco_trainer_overrides():
    from transformers import Trainer

    up_transformers.check_trainer(Trainer)
    bad = type("Renamed", (Trainer,), {"_load_best_model": lambda self, path: None})
    with pytest.raises(TypeError, match=r"Renamed._load_best_model is \(self, path\), taco_trainer overrides it"):
        up_transformers.check_trainer(bad)


def test_the_trainer_builds_its_accelerator_from_its_modules_name():
    import transformers.trainer as trainer_module
    from transformers import Trainer

    builder = getattr(Trainer, up_transformers.BUILDER)
    assert "Accelerator(**args)" in inspect.getsource(builder)  # the module-level name, looked up per call
    original, seen = trainer_module.Accelerator, []
    with up_transformers.building_accelerator(lambda **kw: seen.append(up_transformers.trainer_building_accelerator())):
        assert trainer_module.Accelerator is not original
    assert trainer_module.Accelerator is original
    assert up_transformers.trainer_building_accelerator() is None  # no Trainer building here


def test_training_arguments_set_devices_up_in_a_cached_property():
    from functools import cached_property

    from transformers import TrainingArguments

    assert isinstance(inspect.getattr_static(TrainingArguments, "_setup_devices"), cached_property)


# -- peft -------------------------------------------------------------------------------------

def test_peft_registers_custom_modules_and_casts_inputs():
    from peft import LoraConfig
    from peft.tuners.lora.layer import LoraLayer

    assert list(inspect.signature(LoraConfig._register_custom_module).parameters) == ["self", "mapping"]
    config = LoraConfig(r=2, target_modules=["x"])
    up_peft.register_custom_modules(config, {torch.nn.Identity: torch.nn.Identity})
    assert config._custom_modules == {torch.nn.Identity: torch.nn.Identity}
    assert list(inspect.signature(LoraLayer._cast_input_dtype).parameters) == ["self", "x", "dtype"]


# -- trl --------------------------------------------------------------------------------------

def test_trl_trainers_divide_token_counts_by_tp_size():
    from trl import DPOTrainer, SFTTrainer

    for cls in (SFTTrainer, DPOTrainer):
        assert "self._tp_size = " in inspect.getsource(cls.__init__), cls.__name__


def test_trl_fused_head_takes_the_keyword():
    from trl.trainer.utils import add_fused_lm_head

    from taco_accel.models.tiny import tiny_model

    model = tiny_model("qwen2")
    assert not up_trl.has_fused_head(model.__dict__.get("forward"))
    add_fused_lm_head(model)
    assert up_trl.has_fused_head(model.__dict__.get("forward"))
