"""Pieces of a compressed message, and the deterministic software pipeline that overlaps them:
one piece's codec work runs while another's messages are in flight.

A compressed collective is written, per piece, as a generator that alternates codec work and
asynchronous communication: it issues a collective (``async_op=True``), ``yield``s, and on
resumption waits on the handle and goes on. `Pipeline` advances every live piece one step
per tick, newest first::

    tick t:  piece t     compress, issue all-to-all            (piece t-1's and t-2's
             piece t-1   wait all-to-all, sum, issue all-gather  messages are in flight
             piece t-2   wait all-gather, decode                 while piece t encodes)

The schedule depends only on the number of pieces, never on timing, so every rank issues
the same collectives in the same order (a requirement of torch.distributed). On NCCL the
collectives run on the process group's own CUDA stream, and ``wait()`` only makes the
current stream wait, so the codec kernels of one piece overlap the transfer of another
without a host sync. On gloo the transfer runs on gloo's worker threads.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

__all__ = ["PIECE_BYTES", "Pipeline", "piece_bounds", "piece_length"]

PIECE_BYTES = 32 * 2**20  # the default of `Compression.piece_bytes`

# PIECE_BYTES (32 MiB) was chosen with
# `taco_accel.bench.projection` (``--pieces``), a replay of this schedule with measured codec
# stage costs over message sizes, links, collective latencies and host costs (the table and its
# command are in benchmarks/results/collectives_cpu.md). The codec runs at about ten times the
# link's bandwidth, so there is little to overlap, and every piece pays two collective latencies
# and its host launches: messages up to 32 MiB go whole; larger ones pipeline.


def piece_bounds(n: int, piece: int) -> list[tuple[int, int]]:
    """[start, stop) bounds cutting ``n`` items into pieces of ``piece`` (the last one shorter)."""
    if piece <= 0 or piece >= n:
        return [(0, n)]
    return [(a, min(a + piece, n)) for a in range(0, n, piece)]


def piece_length(piece_bytes: int, bytes_per_item: int, align: int) -> int:
    """Items per piece: about ``piece_bytes`` of input, a positive multiple of ``align``.

    0 (no split) when ``piece_bytes`` is 0.
    """
    if piece_bytes <= 0:
        return 0
    items = piece_bytes // max(bytes_per_item, 1)
    return max(align, items - items % align)


_END = object()  # what `next` returns for a finished piece


class Pipeline:
    """Piece generators advanced once per `tick`, newest first; `wait` runs them to the end.

    Ticks are the points where other work (a weight-gradient matmul) can run while the pieces'
    messages are in flight; the order of collectives depends only on the number of ticks, so
    every rank must tick at the same points (they do: they run the same program).
    """

    def __init__(self, steps: Iterable[Iterator]) -> None:
        self._pending = iter(steps)
        self._live: list[Iterator] = []  # oldest first
        self._only = None  # a message of one piece: advanced directly (the common case, less host work)
        self.value = None  # what that one piece yielded last (the per-rank kinds: the rank whose part landed)

    @classmethod
    def of(cls, steps: list[Iterator]) -> "Pipeline":
        """A pipeline of ``steps``; a single piece skips the bookkeeping of several."""
        if len(steps) != 1:
            return cls(steps)
        pipeline = cls(())
        pipeline._only = steps[0]
        return pipeline

    def tick(self) -> bool:
        """Start the next piece (if any) and advance every live one; False once all are done."""
        only = self._only
        if only is not None:
            value = next(only, _END)
            if value is not _END:
                self.value = value
                return True
            self._only = None
            return False
        step = next(self._pending, None)
        if step is not None:
            self._live.append(step)
        self._live = [s for s in reversed(self._live) if next(s, _END) is not _END][::-1]
        return step is not None or bool(self._live)

    def wait(self) -> None:
        """Run every piece to its end."""
        while self.tick():
            pass
