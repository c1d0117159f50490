"""A TACO-compressed all-reduce next to the plain one, with the bytes it saved.

    torchrun --nproc-per-node 2 examples/compressed_all_reduce.py
"""

import torch
import torch.distributed as dist

import taco_accel

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank = dist.get_rank()
device = torch.device("cuda", rank % torch.cuda.device_count()) if torch.cuda.is_available() else torch.device("cpu")
torch.manual_seed(rank)
x = torch.randn(8, 1024, 1024, device=device)

exact = x.clone()
dist.all_reduce(exact)
approx = taco_accel.all_reduce(x, config=taco_accel.TacoConfig(), site="example/fwd")
error = ((approx - exact).norm() / exact.norm()).item()
stats = taco_accel.pop_comm_stats()["example/fwd"]
if rank == 0:
    print(f"relative error {error:.4f}; sent {stats.bytes_sent / 2**20:.1f} MiB instead of "
          f"{stats.bytes_uncompressed / 2**20:.1f} MiB ({stats.compression_ratio:.2f}x less)")
dist.destroy_process_group()
