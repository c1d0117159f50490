"""The throughput bench (`taco_accel.bench.throughput`) on the CPU: the nano preset, one timed
step of a plain Accelerate loop, the plain loop with liger-kernel (skipped, saying why, where it is
not installed), the recipes' Trainer at tp=1 and emulated tp=2 compressed, in one rank (the GPU
figures are in benchmarks/RESULTS.md)."""

from __future__ import annotations

from harness import run_ranks

ROWS = ("plain", "liger", "taco_tp1", "emulated_tp2_on")


def _rows() -> tuple[list[dict], str, bool]:
    from transformers.utils import is_liger_kernel_available

    from taco_accel.bench import throughput

    args = throughput.build_parser().parse_args(["--device", "cpu", "--preset", "nano", "--vocab", "384", "--seq-len",
                                                 "32", "--micro-batch-size", "2", "--micro-batches", "2", "--warmup",
                                                 "1", "--steps", "1"])
    results = [throughput.measure(row, args) for row in ROWS]
    return results, throughput.table(results, args), is_liger_kernel_available()


def test_throughput_rows_on_the_cpu():
    results, text, liger = run_ranks(_rows, 1)[0]
    measured = [r for r in results if "skipped" not in r]
    assert [r["row"] for r in measured] == [r for r in ROWS if liger or r != "liger"], results
    for r in measured:
        assert r["tokens_per_s"] > 0 and r["tflops"] > 0 and r["first_step_s"] > 0, r
        assert r["mfu"] is None and r["peak_mem_gib"] is None, r  # no peak rate or device memory on the CPU
        assert f"| {r['row']} |" in text
    if not liger:
        assert "| liger | skipped: liger-kernel is not installed" in text
    # every row counts the same FLOPs per token: the same model and batch
    flops = {round(r["tflops"] * r["step_s"], 12) for r in measured}
    assert len(flops) == 1, results


def test_a_failed_row_says_why():
    from taco_accel.bench.throughput import failure

    dynamo = ("Traceback (most recent call last):\n  File \"x.py\", line 3, in f\n    torch.addmm(\n"
              "torch._dynamo.exc.Unsupported: addmm with out_dtype\n\n"
              "Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace\n")
    assert failure(dynamo) == ["torch._dynamo.exc.Unsupported: addmm with out_dtype"]
    assert failure("killed\nno exception line\nat all\nhere") == ["no exception line", "at all", "here"]
