"""Mixed precision of `taco_accel.Accelerator` over its mesh (`integrations.precision`), in one
process. The refusals on every rank and the scaler's agreement across ranks: test_precision.py."""

from __future__ import annotations

import pytest
import torch
from accelerate.utils import GradScalerKwargs

from taco_accel.integrations import precision
from taco_accel.models.tiny import tiny_model
from taco_accel.parallel import ParallelDims
from taco_accel.parallel.grad_scaler import MeshGradScaler


def test_fp16_gets_the_mesh_scaler_with_the_handlers_settings():
    scaler = precision.mesh_scaler("fp16", GradScalerKwargs(init_scale=128.0, growth_interval=7), "cpu")
    assert isinstance(scaler, MeshGradScaler)  # on CPU too, where Accelerate gives fp16 none
    assert scaler.get_scale() == 128.0 and scaler.get_growth_interval() == 7
    assert precision.mesh_scaler("bf16", None, "cpu") is None and precision.mesh_scaler("no", None, "cpu") is None


def test_fp16_refuses_half_parameters_and_pipelines_naming_the_fix():
    model = tiny_model("qwen3")
    precision.check_precision("fp16", model, pipeline=False)  # fp32 parameters: fine
    with pytest.raises(ValueError, match="pipeline stages.*use mixed_precision='bf16'"):
        precision.check_precision("fp16", model, pipeline=True)
    with pytest.raises(ValueError, match="fp32 trainable parameters.*dtype=torch.float32"):
        precision.check_precision("fp16", model.half(), pipeline=False)
    precision.check_precision("bf16", model, pipeline=True)  # only fp16 has these limits


def test_fsdp_computes_in_bf16_only_when_sharded_under_bf16():
    assert precision.fsdp_param_dtype(ParallelDims(dp=2, tp=2, dp_mode="fsdp"), "bf16") == torch.bfloat16
    assert precision.fsdp_param_dtype(ParallelDims(dp=2, tp=2, dp_mode="fsdp"), "fp16") is None
    assert precision.fsdp_param_dtype(ParallelDims(dp=2, tp=2), "bf16") is None  # DDP replicas
    assert precision.fsdp_param_dtype(ParallelDims(dp=1, tp=2, dp_mode="fsdp"), "bf16") is None
