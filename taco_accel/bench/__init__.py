"""Benchmarks of taco_accel, each runnable as ``python -m taco_accel.bench.<name>``.

- `fidelity`: how precisely the codec and its ablations reproduce TP-like tensors (CPU, figures).
- `codec`: throughput of the fused Triton kernels against separate PyTorch ops.
- `convergence`: loss curves of one training run under TACO and its ablations, with emulated TP.
- `syncs`: the host syncs of a block of code (one training step), counted as a CUDA run pays them,
  also on the CPU (a utility for the benchmarks and the tests, not a command).
"""
