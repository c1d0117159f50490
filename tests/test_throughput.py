"""The throughput bench (`taco_accel.bench.throughput`) on the CPU: the nano preset, one timed
step of a plain Accelerate loop, the recipes' Trainer at tp=1 and emulated tp=2 compressed, in
one rank (the GPU figures are in benchmarks/RESULTS.md)."""

from __future__ import annotations

from harness import run_ranks


def _rows() -> tuple[list[dict], str]:
    from taco_accel.bench import throughput

    args = throughput.build_parser().parse_args(["--device", "cpu", "--preset", "nano", "--seq-len", "32",
                                                 "--micro-batch-size", "2", "--micro-batches", "2", "--warmup",
                                                 "1", "--steps", "1"])
    results = [throughput.measure(row, args) for row in ("plain", "taco_tp1", "emulated_tp2_on")]
    return results, throughput.table(results, args)


def test_throughput_rows_on_the_cpu():
    results, text = run_ranks(_rows, 1)[0]
    for r in results:
        assert r["tokens_per_s"] > 0 and r["tflops"] > 0, r
        assert r["mfu"] is None and r["peak_mem_gib"] is None, r  # no peak rate or device memory on the CPU
        assert f"| {r['row']} |" in text
    # every row counts the same FLOPs per token: the same model and batch
    flops = {round(r["tflops"] * r["step_s"], 12) for r in results}
    assert len(flops) == 1, results
