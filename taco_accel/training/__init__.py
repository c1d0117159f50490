"""Layer 7: the application, what the recipes run: the one training loop and its runs.

`TrainingLoop` (``loop.py``) is the one loop (steps, evaluation, logging, checkpoints, the end
of a run); its runs are the pretraining `Trainer` / `TrainConfig` (``trainer.py``) and the
fine-tuning `Finetuner` / `FinetuneConfig` (``finetune.py``), both on
`taco_accel.Accelerator`; the recipes' model sizes (``presets.py``), their command lines
(``cli.py``, ``finetune_cli.py``), throughput figures and plots (``metrics.py``), what the ranks
of a launched run do together (``ranks.py``) and a local `evaluate` metric
(``token_perplexity/``). The library glue they build on (Accelerate, peft, transformers'
trainers, checkpoints) is `taco_accel.integrations`.
"""

from .finetune import FinetuneConfig, Finetuner
from .loop import TrainingLoop
from .presets import FAMILY_PRESETS, model_config
from .trainer import TrainConfig, Trainer

__all__ = ["FAMILY_PRESETS", "FinetuneConfig", "Finetuner", "TrainConfig", "Trainer", "TrainingLoop", "model_config"]
