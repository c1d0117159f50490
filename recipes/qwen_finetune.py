#!/usr/bin/env python
"""Fine-tune a Qwen2 / Qwen2.5 / Qwen3 checkpoint with TP (TACO-compressed) x DP: LoRA or full.

    accelerate launch --config_file recipes/configs/cpu_tp2.yaml recipes/qwen_finetune.py
    accelerate launch --config_file recipes/configs/node_tp8.yaml recipes/qwen_finetune.py --tp 4 --dp 2 \
        --model Qwen/Qwen2.5-7B-Instruct --data tatsu-lab/alpaca --max-len 1024 --steps 500
    python recipes/qwen_finetune.py --model path/to/checkpoint --method full --steps 50   # one process

Without --model: a random tiny Qwen2 with a byte tokenizer (no network), on the shipped sample
data (recipes/data/sft_sample.jsonl, prompt / response pairs). Writes OUTPUT_DIR/adapter (peft),
OUTPUT_DIR/merged (transformers) or OUTPUT_DIR/final (full), eval_results.json, history.jsonl.
See ``--help`` and recipes/README.md.
"""

from pathlib import Path

from taco_accel.training.finetune_cli import main

if __name__ == "__main__":
    main("qwen2", __doc__.splitlines()[1], default_data=str(Path(__file__).parent / "data" / "sft_sample.jsonl"))
