#!/usr/bin/env python
"""Pretrain a Qwen2-architecture causal LM with TP (TACO-compressed) x PP x DP.

    accelerate launch --config_file recipes/configs/cpu_tp2.yaml recipes/qwen_pretrain.py
    accelerate launch --config_file recipes/configs/node_tp4_pp2.yaml recipes/qwen_pretrain.py --preset 1.5b
    python recipes/qwen_pretrain.py --steps 50          # one process

Sizes: --preset nano | tiny (default, about a minute on 2 CPU processes) | small | 0.5b | 1.5b | 7b.
See ``--help`` and recipes/README.md.
"""

from taco_accel.training.cli import main

if __name__ == "__main__":
    main("qwen2", __doc__.splitlines()[1])
