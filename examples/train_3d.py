"""A 3D-parallel run (dp=2 x pp=2 x tp=2) of the shared trainer, from Python.

    torchrun --nproc-per-node 8 examples/train_3d.py        # 8 CPU processes: slow but works
    (on GPUs: accelerate launch --config_file recipes/configs/node_dp2_pp2_tp2.yaml examples/train_3d.py)
"""

import logging
import os

import taco_accel

main = os.environ.get("RANK", "0") == "0"
logging.basicConfig(level=logging.INFO if main else logging.WARNING, format="%(name)s: %(message)s")
config = taco_accel.TrainConfig(
    family="qwen2", preset="nano", dp=2, pp=2, tp=2, schedule="1f1b", micro_batches=4, seq_len=64, steps=20,
    compression=taco_accel.TacoConfig(group_size=32), eval_every=10,
    output_dir="runs/example_3d", trackers=(),
)
history = taco_accel.Trainer(config).train()
if main:
    print(f"final loss {history[-1]['loss']:.3f}, validation {history[-1]['val_loss']:.3f}")
