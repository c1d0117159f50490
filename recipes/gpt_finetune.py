#!/usr/bin/env python
"""Fine-tune a GPT-2 checkpoint (fused Conv1D q|k|v, tied head) with TP (TACO-compressed) x DP: LoRA or full.

    accelerate launch --config_file recipes/configs/cpu_tp2.yaml recipes/gpt_finetune.py
    accelerate launch --config_file recipes/configs/node_tp4_pp2.yaml recipes/gpt_finetune.py --tp 4 --dp 2 \
        --model openai-community/gpt2-large --data train.jsonl --format plain

Without --model: a random tiny GPT-2 with a byte tokenizer (no network), on the shipped sample
data. Same flags and outputs as qwen_finetune.py (``--help``).
"""

from pathlib import Path

from taco_accel.training.finetune_cli import main

if __name__ == "__main__":
    main("gpt2", __doc__.splitlines()[1], default_data=str(Path(__file__).parent / "data" / "sft_sample.jsonl"))
