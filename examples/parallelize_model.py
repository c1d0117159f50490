"""Make a transformers model tensor parallel with TACO-compressed collectives, and compare its
loss with the plain model's.

    torchrun --nproc-per-node 2 examples/parallelize_model.py
"""

import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

import taco_accel

dist.init_process_group("gloo")
config = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
torch.manual_seed(0)  # the same weights on every rank
model = Qwen2ForCausalLM(config)
reference = Qwen2ForCausalLM(config)
reference.load_state_dict(model.state_dict())

taco_accel.parallelize(model, compression="on")  # tp = world size; every message compressed
ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
loss = model(ids, labels=ids).loss
loss.backward()  # backward collectives are compressed too
if dist.get_rank() == 0:
    print(model.model.layers[0].mlp)
    print(f"loss with tp={dist.get_world_size()} + TACO: {loss.item():.5f}, "
          f"plain model: {reference(ids, labels=ids).loss.item():.5f}")
dist.destroy_process_group()
