#!/usr/bin/env python
"""Pretrain a GPT-2-architecture causal LM with TP (TACO-compressed) x PP x DP.

    accelerate launch --config_file recipes/configs/cpu_tp2.yaml recipes/gpt_pretrain.py
    accelerate launch --config_file recipes/configs/node_tp8.yaml recipes/gpt_pretrain.py --preset 6.7b
    python recipes/gpt_pretrain.py --steps 50           # one process

Sizes: --preset nano | tiny (default) | 124m | 350m | 774m | 1.5b | 6.7b. The head is tied to
the token embedding, as in GPT-2; across pipeline stages the two copies are kept equal.
See ``--help`` and recipes/README.md.
"""

from taco_accel.training.cli import main

if __name__ == "__main__":
    main("gpt2", __doc__.splitlines()[1])
