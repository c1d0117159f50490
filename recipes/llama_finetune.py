#!/usr/bin/env python
"""Fine-tune a Llama-like checkpoint (Llama, Mistral) with TP (TACO-compressed) x DP: LoRA or full.

    accelerate launch --config_file recipes/configs/cpu_tp2.yaml recipes/llama_finetune.py
    accelerate launch --config_file recipes/configs/node_tp8.yaml recipes/llama_finetune.py \
        --model meta-llama/Llama-3.1-8B-Instruct --data HuggingFaceH4/no_robots --eval-split test

Without --model: a random tiny Llama (one kv head, replicated over the tp ranks) with a byte
tokenizer (no network), on the shipped sample data. Same flags and outputs as qwen_finetune.py.
"""

from pathlib import Path

from taco_accel.training.finetune_cli import main

if __name__ == "__main__":
    main("llama", __doc__.splitlines()[1], default_data=str(Path(__file__).parent / "data" / "sft_sample.jsonl"))
