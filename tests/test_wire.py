"""The wire carries its config: a buffer read under another TacoConfig raises WireFormatError.

Each chunk ends its payload and scales with a 4-byte header (`codec.layout`: version, G, format,
scale layout, Hadamard, random signs and a hash of their seed). `decompress` and `sum_packed`,
where a buffer meets a config, check it; so do the collectives' receive side
(`codec.api.compare_headers`: on the CPU at once; tests/test_comm.py runs its GPU path). The mismatches here have buffers of the same size, which decoded to numbers before.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_ranks
from taco_accel import comm
from taco_accel.codec import Packed, TacoConfig, WireFormatError, WireLayout, check_wire, compress, decompress, sum_packed

BASE = TacoConfig(backend="torch")
# (writer, reader) pairs whose buffers have the same size (1024 values, one or two chunks)
MISMATCHES = {
    "format": (BASE, BASE.replace(format="int8")),
    "hadamard": (BASE, BASE.replace(hadamard=False)),
    "random signs": (BASE, BASE.replace(random_signs=True)),
    "sign seed": (BASE.replace(random_signs=True), BASE.replace(random_signs=True, sign_seed=1)),
    "group size and scale layout": (BASE.replace(group_size=128, scales="dual"), BASE.replace(group_size=64)),
    "e4m3 / e5m2": (BASE, BASE.replace(format="e5m2")),
}


def read_as(packed: Packed, config: TacoConfig) -> Packed:
    """``packed``'s bytes under another config, with that config's own layout of the same size."""
    layout = WireLayout.for_tensor(packed.layout.numel, config, packed.layout.chunks)
    assert layout.total_bytes == packed.nbytes, "the mismatch must not change the size"
    return Packed(packed.buffer, packed.shape, packed.dtype, config, layout)


@pytest.mark.parametrize("chunks", (1, 2))
@pytest.mark.parametrize("mismatch", MISMATCHES)
def test_decompress_under_another_config_raises(mismatch, chunks):
    writer, reader = MISMATCHES[mismatch]
    x = torch.randn(1024, generator=torch.Generator().manual_seed(1))
    packed = compress(x, writer, chunks=chunks)
    assert torch.equal(decompress(packed), decompress(read_as(packed, writer)))  # the same config reads
    with pytest.raises(WireFormatError, match=r"chunk 0 of the buffer was written with group_size=.* but is read with"):
        decompress(read_as(packed, reader))


@pytest.mark.parametrize("mismatch", MISMATCHES)
def test_sum_packed_of_a_buffer_of_another_config_raises(mismatch):
    """The reduce step of the two-shot all-reduce: one peer's chunk written under another config."""
    writer, reader = MISMATCHES[mismatch]
    xs = torch.randn(3, 1024, generator=torch.Generator().manual_seed(2))
    good = [compress(x, reader) for x in xs[:2]]
    odd = compress(xs[2], writer)
    stacked = torch.stack([good[0].buffer, good[1].buffer, odd.buffer])
    sum_packed(stacked[:2], good[0].layout, reader)  # fine without the odd one
    with pytest.raises(WireFormatError, match="input 2, chunk 0 of the buffer was written with"):
        sum_packed(stacked, good[0].layout, reader)


def test_a_buffer_that_is_not_one_raises():
    """Bytes that no encoder wrote (zeros, or a buffer read with another layout of its size)."""
    x = torch.randn(1000)
    packed = compress(x, BASE)
    zeros = Packed(torch.zeros_like(packed.buffer), packed.shape, packed.dtype, BASE, packed.layout)
    with pytest.raises(WireFormatError, match="no header"):
        decompress(zeros)
    other = WireLayout.for_tensor(1000, BASE.replace(group_size=64))
    with pytest.raises(WireFormatError, match="does not belong to TacoConfig"):
        check_wire(packed.buffer, other, BASE)
    check_wire(packed.buffer, packed.layout, BASE)


# --- the collectives' receive side, on 2 gloo ranks ----------------------------------------------


def _mismatched_ranks() -> dict:
    """Rank 1 compresses as int8, rank 0 as e4m3 (same bytes per value): every op must raise on
    both ranks, where the peer's buffer meets this rank's config. The calls' agreement check
    (`comm.agreement`, which would catch this first) is off: this is the line behind it, for
    the calls it does not check."""
    import torch.distributed as dist

    from taco_accel.comm import agreement

    agreement.CHECKED_CALLS = 0
    rank = dist.get_rank()
    config = TacoConfig(format="int8" if rank else "e4m3")
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(rank))
    errors = {}
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        try:
            getattr(comm, op)(x, None, config)
            errors[op] = None
        except WireFormatError as error:
            errors[op] = str(error)
    same = TacoConfig()
    comm.all_reduce(x, None, same)  # the group still works with one config
    return errors


def test_collectives_raise_where_ranks_use_other_configs():
    for rank, errors in enumerate(run_ranks(_mismatched_ranks, 2)):
        for op, message in errors.items():
            assert message is not None, (rank, op)
            written, read = ("'int8'", "'e4m3'") if rank == 0 else ("'e4m3'", "'int8'")
            assert f"format={written}" in message.split("but is read with")[0], (rank, op, message)
            assert f"format={read}" in message.split("but is read with")[1], (rank, op, message)


def test_off_the_cpu_each_config_and_layout_is_checked_once(monkeypatch):
    """Reading a header off the CPU costs a host sync: there each (config, layout, device) is
    checked on its first buffer only, and every CPU buffer is checked (meta tensors stand in for a
    GPU's: the reference decodes them without data)."""
    from taco_accel.codec import api

    checked = []
    monkeypatch.setattr(api, "check_wire", lambda buffer, layout, config, tag=0: checked.append(buffer.device.type))
    layout = WireLayout.for_tensor(1003, BASE)  # a size no other test reads off the CPU
    for device in ("meta", "meta", "cpu", "cpu"):
        buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device)
        decompress(Packed(buffer, torch.Size([1003]), torch.float32, BASE, layout))
        sum_packed(buffer[None], layout, BASE)
    assert checked == ["meta", "cpu", "cpu", "cpu", "cpu"]
    other = BASE.replace(format="int8")  # another config of the same layout: checked again
    decompress(Packed(torch.zeros(layout.total_bytes, dtype=torch.uint8, device="meta"), torch.Size([1003]),
                      torch.float32, other, layout))
    assert checked[-1] == "meta" and len(checked) == 6


def test_a_chunk_of_another_message_length_raises():
    """The collectives tag each chunk with the message's length (`layout.length_tag`): a chunk of
    a message of another length, same wire size, fails the read instead of decoding."""
    from taco_accel.codec.api import decode_into, encode_into, sum_packed_into
    from taco_accel.codec.layout import length_tag

    assert length_tag(4000) != length_tag(4090) and length_tag(4000) != length_tag(4000 + (1 << 16))
    layout = WireLayout.for_tensor(4096, BASE)
    wire = torch.empty(layout.total_bytes, dtype=torch.uint8)
    encode_into(torch.ones(4096), wire, layout, BASE, tag=length_tag(4000))
    out = torch.empty(4096)
    decode_into(wire, layout, BASE, out, tag=length_tag(4000))  # the same length: read, as untagged bytes are
    assert torch.equal(out, decompress(compress(torch.ones(4096), BASE)))
    for read in (lambda: decode_into(wire, layout, BASE, out, tag=length_tag(4090)),
                 lambda: sum_packed_into(wire[None], layout, BASE, torch.empty_like(wire), tag=length_tag(4090))):
        with pytest.raises(WireFormatError, match="message of another length"):
            read()
    with pytest.raises(WireFormatError, match="format="):  # untagged reads of a tagged chunk: a plain mismatch
        decompress(Packed(wire, torch.Size([4096]), torch.float32, BASE, layout))
    with pytest.raises(WireFormatError, match="another length \\(bytes") as length_only:
        decode_into(wire, layout, BASE, out, tag=length_tag(4090))
    assert "sign_seed" not in str(length_only.value)  # no random signs: only a length can differ there
    signed = BASE.replace(random_signs=True)  # bytes 2-3 hold the seed's hash XOR the tag: one cannot tell which
    encode_into(torch.ones(4096), wire, layout, signed, tag=length_tag(4000))
    for reader, tag in ((signed.replace(sign_seed=1), 4000), (signed, 4090)):
        with pytest.raises(WireFormatError, match="another length or another sign_seed"):
            decode_into(wire, layout, reader, out, tag=length_tag(tag))


def test_compress_of_a_meta_tensor_says_so():
    with pytest.raises(ValueError, match="meta tensor .*materialise it"):
        compress(torch.empty(300, device="meta"), BASE)


def test_header_flags_keep_a_mismatch_until_read(monkeypatch):
    """`codec.api.HeaderFlags` off the CPU (`READ_AT_ONCE` emptied: the same code on CPU tensors):
    a chunk of another length, met once among more matching calls than the flags' ring holds,
    reads as NaN and is still reported at the next read; a read that finds none starts afresh."""
    from taco_accel.codec import api
    from taco_accel.codec.layout import length_tag

    monkeypatch.setattr(api, "READ_AT_ONCE", ())
    layout = WireLayout.for_tensor(4096, BASE, 2)
    stack = torch.empty(2, layout.total_bytes, dtype=torch.uint8)  # two ranks' buffers, as received
    for row in stack:
        api.encode_into(torch.ones(4096), row, layout, BASE, tag=length_tag(4000))
    odd = stack.clone()
    api.encode_into(torch.ones(4096), odd[1], layout, BASE, tag=length_tag(4090))
    flags, views = api.HeaderFlags(), api.header_views(stack, layout)
    for calls in (3, 2 * api.HeaderFlags.RING + 3):  # the second: the ring used up twice between reads
        for call in range(calls):
            stack.copy_(odd if call == 1 else odd[0].expand_as(odd))
            api.compare_headers(stack, layout, BASE, length_tag(4000), flags, views)
            if call == 1:
                assert views.scales[1].isnan().all() and not views.scales[0].isnan().any()
        with pytest.raises(WireFormatError, match="message of another length"):
            api.raise_mismatches(flags, "site")
        assert not api.any_mismatch([flags])
        for _ in range(calls):
            api.compare_headers(stack, layout, BASE, length_tag(4000), flags, views)
        assert not api.any_mismatch([flags])


def _received(tags: list[int], layout: WireLayout) -> torch.Tensor:
    """Two ranks' buffers as one rank receives them, each chunk tagged with the length in ``tags``."""
    from taco_accel.codec import api
    from taco_accel.codec.layout import length_tag

    stack = torch.empty(len(tags), layout.total_bytes, dtype=torch.uint8)
    for row, tag in zip(stack, tags):
        api.encode_into(torch.ones(4096), row, layout, BASE, tag=length_tag(tag))
    return stack


def test_one_flag_for_many_sites_is_read_once_and_settled(monkeypatch):
    """`codec.api.mismatch_flag` / `settle_flags` and `comm.stats.WireCheck`, what a training step
    folds into a host read it makes anyway: one device flag for every site's comparisons since
    their last read; nothing compared since, nothing covered; a clean read marks them read (the
    comparisons written after it stay to be read); a set flag raises naming the site, and a flag
    set by another rank (a sum over ranks) raises saying so."""
    from taco_accel.codec import api
    from taco_accel.codec.layout import length_tag
    from taco_accel.comm.stats import WireCheck

    monkeypatch.setattr(api, "READ_AT_ONCE", ())
    layout = WireLayout.for_tensor(4096, BASE, 2)
    good, bad = _received([4000, 4000], layout), _received([4000, 4090], layout)
    ledger = comm.Ledger()
    sites = [ledger.record(f"layers.{i}/fwd").header_flags for i in range(3)]

    def compare(site: int, stack: torch.Tensor) -> None:
        api.compare_headers(stack, layout, BASE, length_tag(4000), sites[site], api.header_views(stack, layout))

    check = WireCheck([ledger], "cpu")
    assert check.empty and float(check.flag) == 0.0  # nothing compared yet: nothing to read
    for site in range(3):
        compare(site, good)
    check = WireCheck([ledger], "cpu")
    assert not check.empty and float(check.flag) == 0.0
    compare(1, bad)  # after the flag was taken: not covered by it, not marked read by its settle
    check.settle(False)
    assert [len(flags.pending()) for flags in sites] == [0, 1, 0]
    check = WireCheck([ledger], "cpu")
    assert float(check.flag) == 1.0
    with pytest.raises(WireFormatError, match=r"^layers.1/fwd: .*message of another length"):
        check.settle(True)
    assert WireCheck([ledger], "cpu").empty  # read, and raised: started afresh
    for site in range(3):
        compare(site, good)
    check = WireCheck([ledger], "cpu")
    with pytest.raises(WireFormatError, match="another rank received .* that rank's error names the site"):
        check.settle(True)  # this rank's chunks were fine; a peer's were not
    assert ledger.pop() == {}  # the flags were read: the pop reads nothing more, and raises nothing


@pytest.mark.parametrize("value,deferred", [("1", True), ("true", True), ("0", False), ("", False)])
def test_defer_header_reads_is_a_switch(monkeypatch, value, deferred):
    """``TACO_DEFER_HEADER_READS=1`` runs the GPU's deferred header reads on the CPU (read at first
    use, as the ranks set it after the import); anything but a switch names the valid values."""
    from taco_accel.codec import api

    monkeypatch.setattr(api, "READ_AT_ONCE", None)
    monkeypatch.setenv(api.DEFER_ENV, value)
    assert api.read_at_once() == (() if deferred else ("cpu",))
    monkeypatch.setattr(api, "READ_AT_ONCE", None)
    monkeypatch.setenv(api.DEFER_ENV, "later")
    with pytest.raises(ValueError, match="TACO_DEFER_HEADER_READS='later' is not a switch; set it to 1"):
        api.read_at_once()
