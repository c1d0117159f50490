"""Layer 6: Accelerate glue and the shared training loop of the recipes.

The only layer that knows Accelerate: `make_accelerator` (process state, autocast, trackers),
`parallel_dims_from_launch` (mesh sizes from ``accelerate launch``), `Trainer` / `TrainConfig`
(the loop both recipes run), sharded checkpoints and the final transformers export.
"""

from .accelerate import make_accelerator, parallel_dims_from_launch
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .export import export_pretrained, gather_full_state_dict
from .presets import FAMILY_PRESETS, model_config
from .trainer import TrainConfig, Trainer

__all__ = [
    "FAMILY_PRESETS",
    "TrainConfig",
    "Trainer",
    "export_pretrained",
    "gather_full_state_dict",
    "latest_checkpoint",
    "load_checkpoint",
    "make_accelerator",
    "model_config",
    "parallel_dims_from_launch",
    "save_checkpoint",
]
