"""taco_accel: tensor-parallel training for Hugging Face models with FP8-compressed TP communication."""

from .errors import (
    CheckpointError,
    CollectiveMismatch,
    CollectiveTimeout,
    ConfigError,
    DataError,
    ConfigTypeError,
    EnvironmentSettingError,
    GroupOverflowError,
    NonFiniteError,
    OutputExistsError,
    TacoError,
    WireFormatError,
)
from .codec import Packed, TacoConfig, calibrate, compress, decompress
from .comm import all_gather, all_reduce, pop_comm_stats, reduce_scatter
from .models import (
    TPPlan,
    calibrate_group_sizes,
    from_pretrained,
    parallelize,
    register_plan,
    save_pretrained,
    supported_model_types,
)
from .comm import Compression
from .parallel import ParallelDims, build_mesh
from .integrations import (
    Accelerator,
    export_merged,
    get_peft_model,
    load_adapter,
    save_adapter,
    taco_trainer,
)
from .training import TrainConfig, Trainer

__version__ = "0.1.0"

__all__ = [
    "Accelerator",
    "CheckpointError",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "Compression",
    "ConfigError",
    "DataError",
    "ConfigTypeError",
    "EnvironmentSettingError",
    "GroupOverflowError",
    "NonFiniteError",
    "OutputExistsError",
    "Packed",
    "ParallelDims",
    "TPPlan",
    "TacoConfig",
    "TacoError",
    "TrainConfig",
    "WireFormatError",
    "Trainer",
    "all_gather",
    "all_reduce",
    "build_mesh",
    "calibrate",
    "calibrate_group_sizes",
    "compress",
    "decompress",
    "export_merged",
    "from_pretrained",
    "get_peft_model",
    "load_adapter",
    "parallelize",
    "pop_comm_stats",
    "reduce_scatter",
    "register_plan",
    "save_adapter",
    "save_pretrained",
    "supported_model_types",
    "taco_trainer",
]
