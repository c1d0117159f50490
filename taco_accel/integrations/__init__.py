"""Layer 6: the library glue to Accelerate, peft and transformers' trainers.

The only layer that knows Accelerate and peft: `Accelerator` (``accelerate.Accelerator`` for
TACO tensor-parallel models, adapting Accelerate's methods to a module per concern: the mesh's
sizes, ``sizes.py``; the models laid out on it, ``laid_out.py``; fp16 scaling and precision
checks, ``precision.py``; gradient reduction and clipping over the mesh, ``gradients.py``; the
wire-header errors of a step, raised at its optimizer step, ``wire.py``;
``gather`` / ``reduce`` over the replicas, ``replicas.py``; reshardable ``save_state`` /
``load_state``, ``saving.py`` over `checkpoint`; the communication figures, ``statistics.py``;
what ``accelerate launch`` hands a process, ``launch.py``); peft LoRA on the parallel layers
(`get_peft_model`, `save_adapter`, `load_adapter`, `export_merged`); `taco_trainer`,
transformers' ``Trainer`` (and TRL's trainers) on `Accelerator`. The recipes' runs built on
these are `taco_accel.training`.
"""

from .accelerator import Accelerator
from .hf_trainer import taco_trainer
from .lora import export_merged, gather_adapter_state_dict, get_peft_model, load_adapter, save_adapter

__all__ = [
    "Accelerator",
    "export_merged",
    "gather_adapter_state_dict",
    "get_peft_model",
    "load_adapter",
    "save_adapter",
    "taco_trainer",
]
