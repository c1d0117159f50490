"""Layer 6: Accelerate and peft glue, and the training loops of the recipes.

The only layer that knows Accelerate and peft: `Accelerator` (``accelerate.Accelerator`` for
TACO tensor-parallel models: the mesh, ``prepare``, gradient reduction and clipping over the
mesh, reshardable ``save_state`` / ``load_state``), the pretraining `Trainer` / `TrainConfig` and
the fine-tuning `Finetuner` / `FinetuneConfig` built on it, the final transformers export;
peft LoRA on the parallel layers (`get_peft_model`, `save_adapter`, `load_adapter`,
`export_merged`); `taco_trainer`, transformers' ``Trainer`` (and TRL's trainers) on `Accelerator`.
"""

from .accelerator import Accelerator
from .export import export_pretrained, gather_full_state_dict
from .finetune import FinetuneConfig, Finetuner
from .hf_trainer import taco_trainer
from .lora import export_merged, gather_adapter_state_dict, get_peft_model, load_adapter, save_adapter
from .presets import FAMILY_PRESETS, model_config
from .trainer import TrainConfig, Trainer

__all__ = [
    "Accelerator",
    "FAMILY_PRESETS",
    "FinetuneConfig",
    "Finetuner",
    "TrainConfig",
    "Trainer",
    "export_merged",
    "export_pretrained",
    "gather_adapter_state_dict",
    "gather_full_state_dict",
    "get_peft_model",
    "load_adapter",
    "model_config",
    "save_adapter",
    "taco_trainer",
]
