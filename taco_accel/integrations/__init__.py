"""Layer 6: Accelerate glue and the shared training loop of the recipes.

The only layer that knows Accelerate: `make_accelerator` (process state, autocast, trackers),
`parallel_dims_from_launch` (mesh sizes from ``accelerate launch``), `Trainer` / `TrainConfig`
(the loop both recipes run), sharded checkpoints and the final transformers export; peft LoRA
on the parallel layers (`get_peft_model`, `save_adapter`, `load_adapter`, `export_merged`) and the
fine-tuning loop of the fine-tuning recipes (`Finetuner` / `FinetuneConfig`).
"""

from .accelerate import make_accelerator, parallel_dims_from_launch
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .export import export_pretrained, gather_full_state_dict
from .finetune import FinetuneConfig, Finetuner
from .lora import export_merged, gather_adapter_state_dict, get_peft_model, load_adapter, save_adapter
from .presets import FAMILY_PRESETS, model_config
from .trainer import TrainConfig, Trainer

__all__ = [
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
    "latest_checkpoint",
    "load_adapter",
    "load_checkpoint",
    "make_accelerator",
    "model_config",
    "parallel_dims_from_launch",
    "save_adapter",
    "save_checkpoint",
]
