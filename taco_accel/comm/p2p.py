"""Point-to-point messages through the codec: what a pipeline stage boundary sends.

A `Channel` is one direction of one link between two ranks, seen from one end: its `site.Site`
(the settings, the plain-or-compressed decision, the record in a `stats.Ledger`) and whether this
rank sends or receives (layer 5 names them after the boundary: ``pp.0-1/fwd`` carries the
activations stage 0 sends to stage 1, ``pp.0-1/bwd`` their gradients, sent back). The transfers
themselves are the caller's (torch.distributed.pipelining's schedules issue them): a channel says
what travels.

    tensor = channel.outgoing(x, slot)      # sender: x itself (plain) or its wire buffer (uint8)
    tensor = channel.incoming(buffer, slot) # receiver: receive into buffer itself, or into a wire buffer
    channel.land(slot)                      # receiver, after the receive: decode the wire into buffer

Both ends take the same decision for every message from what both hold: the site's settings and
decision (`check` compares them across the link before the first message) and the message's
shape and dtype (the sender's tensor and the receiver's buffer are alike). A message no decision
covers yet (``"auto"`` mode: not timed at this size) is sent plain and remembered; `settle`,
called on both ends between transfers, then times plain against compressed on the link
(`autotune`, kind ``"send"``: the two ranks swap a message of that shape, encoding before and
decoding after), and the messages that follow obey the verdict. The timing cannot run inside a
schedule: it is a blocking exchange of the two ranks, which the schedule's own order of
asynchronous sends and receives may not allow.

Wire format: one `codec.layout.WireLayout` chunk (`codec.compress` of the message), a uint8
buffer whose header names the settings; the receiver decodes it with its own (checked) settings.

Non-finite values (``TacoConfig.nonfinite``): ``"propagate"`` decodes a group holding NaN or Inf
to NaN; ``"zero"`` sends them as 0 (plain messages too, through a copy); ``"raise"`` sends them as
0 as well and keeps a flag on the sender (`nonfinite`): the caller raises `NonFiniteError` on
every rank once the schedule is over (a schedule cannot stop half-way without leaving its peers
waiting for messages), and the zeros keep the rest of that step finite.

Statistics: the sender records each message in the site's `stats.SiteRecord` (bytes sent
against the message's own size; the receiver records nothing, so a ledger sum counts each byte
once); sampled messages (`stats.set_error_sampling`) also keep the relative error of the round
trip, measured on the sender, which decodes its own wire (the receiver decodes the same bytes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..codec import CodecConfig, WireLayout
from ..codec.api import decode_into, encode_into
from . import agreement
from .call import finite, nonfinite_error, relative_error

KIND = "send"  # the kind of a point-to-point message, in timings and agreement checks


def zeroing_codec(codec: CodecConfig) -> CodecConfig:
    """The settings a point-to-point message is encoded with: under ``"raise"`` the non-finite
    values travel as zeros (the flag is the sender's; a collective propagates them instead:
    `call.propagating_codec`)."""
    return codec if codec.nonfinite != "raise" else codec.replace(nonfinite="zero")


def encode(x: torch.Tensor, codec: CodecConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """The one-chunk wire buffer of ``x`` (``out``: a uint8 buffer of its size to reuse)."""
    layout = WireLayout.for_tensor(x.numel(), codec)
    if out is None or out.numel() != layout.total_bytes:
        out = torch.empty(layout.total_bytes, dtype=torch.uint8, device=x.device)
    encode_into(x.contiguous(), out, layout, codec)
    return out


def decode(wire: torch.Tensor, codec: CodecConfig, out: torch.Tensor) -> torch.Tensor:
    """``out`` (contiguous) <- the values of ``wire`` (`encode` of as many values, under ``codec``)."""
    decode_into(wire, WireLayout.for_tensor(out.numel(), codec), codec, out)
    return out


class Channel:
    """One direction of a link, from one end; see the module docstring.

    ``site``: a `site.Site` whose group holds exactly the two ranks of the link (None: no link,
    the emulation of `round_trip_message` in one process); ``sends``: this rank is the sender.
    """

    def __init__(self, site, sends: bool) -> None:
        self.site, self.sends = site, sends
        self.pending: tuple | None = None  # (shape, dtype, device) of a message sent plain, undecided
        self.flags: list[torch.Tensor] = []  # this step's non-finite flags (sender, "raise")
        self._wires: dict = {}  # slot -> uint8 buffer (sent or received), reused from step to step
        self._landing: dict = {}  # slot -> (wire, buffer, codec): received, not decoded yet

    @property
    def name(self) -> str:
        return self.site.name

    # -- the decision of one message ------------------------------------------------------------

    def compresses(self, shape, dtype: torch.dtype, device) -> bool:
        """Whether a message of ``shape`` and ``dtype`` is compressed now (the same answer on both
        ends); an undecided auto site says plain and remembers the message for `settle`."""
        site = self.site
        settled = site.settled(torch.Size(shape).numel() * dtype.itemsize, dtype)
        if settled is not None:
            return settled
        if not site.decider.timed:  # no link to time: the size rule, taken on the spot
            return site.compresses_like(KIND, shape, dtype, device)
        self.pending = (tuple(shape), dtype, device)
        return False

    # -- sender -----------------------------------------------------------------------------------

    def outgoing(self, x: torch.Tensor, slot) -> torch.Tensor:
        """The tensor to send for ``x`` (kept alive here until the slot is used again): x itself,
        its wire buffer, or (``"zero"`` / ``"raise"``, plain) a copy without non-finite values.
        Recorded in the site's record: the bytes sent against the message's own size."""
        record, codec = self.site.record, self.site.config
        nbytes = x.numel() * x.element_size()
        out, compressed = x, False
        if codec is not None and x.is_floating_point():
            if codec.nonfinite == "raise":
                self.flags.append(~torch.isfinite(x).all())
            compressed = self.compresses(x.shape, x.dtype, x.device)
            if compressed:
                out = self._wires[slot] = encode(x, zeroing_codec(codec), self._wires.get(slot))
            elif codec.nonfinite != "propagate":
                out = finite(x)
        record.add(out.numel() if compressed else nbytes, nbytes, compressed)
        if compressed and record.sample_due():
            record.errors.append(relative_error(decode(out, zeroing_codec(codec), torch.empty_like(x)), x.double()))
        return out

    def nonfinite(self) -> torch.Tensor | None:
        """A 0-d bool tensor: a message sent since the last call held NaN or Inf (None: nothing
        checked); then forget them."""
        flags, self.flags = self.flags, []
        return torch.stack(flags).any() if flags else None

    # -- receiver ---------------------------------------------------------------------------------

    def incoming(self, buffer: torch.Tensor, slot) -> torch.Tensor:
        """The tensor to receive the message for ``buffer`` into: buffer itself (plain), or a wire
        buffer that `land` decodes into it."""
        codec = self.site.config
        if codec is None or not buffer.is_floating_point() or not self.compresses(buffer.shape, buffer.dtype,
                                                                                  buffer.device):
            return buffer
        codec = zeroing_codec(codec)
        size = WireLayout.for_tensor(buffer.numel(), codec).total_bytes
        wire = self._wires.get(slot)
        if wire is None or wire.numel() != size:
            wire = self._wires[slot] = torch.empty(size, dtype=torch.uint8, device=buffer.device)
        self._landing[slot] = (wire, buffer, codec)
        return wire

    def land(self, slot) -> None:
        """Decode the message received for ``slot`` into its buffer (nothing if it came plain)."""
        found = self._landing.pop(slot, None)
        if found is not None:
            wire, buffer, codec = found
            with torch.no_grad():  # the buffer may be a leaf that requires grad (a stage input)
                decode(wire, codec, buffer)

    def forget(self) -> None:
        """Drop what an interrupted step left (received messages not decoded, flags)."""
        self._landing.clear()
        self.flags = []

    # -- between transfers: both ends of the link, in the same order ----------------------------

    def check(self, device: torch.device) -> None:
        """The first-call agreement check (every call with ``TACO_CHECK_COLLECTIVES=1``) of the
        site's settings against the other end's: a `CollectiveMismatch` on both ends naming the
        site and what differs. A collective of the two ranks."""
        site = self.site
        if agreement.due(site.record):
            agreement.check(KIND, torch.Size([0]), torch.float32, device, site.link, site.config, False, site.name,
                            site.piece_bytes, mode=site.mode)

    def settle(self) -> None:
        """Time the message sent plain while undecided, if any (a collective of the two ranks)."""
        if self.pending is not None:
            shape, dtype, device = self.pending
            self.pending = None
            self.site.compresses_like(KIND, shape, dtype, device)

    def __repr__(self) -> str:
        return f"Channel({self.site!r}, {'sends' if self.sends else 'receives'})"


def round_trip_message(site, x: torch.Tensor) -> torch.Tensor:
    """One message of ``site`` sent and received in one process (an emulated link): recorded like
    a sent one, and decoded from its wire where the site compresses it. Non-finite values follow
    the site's policy, ``"raise"`` raising `NonFiniteError` at once."""
    channel = Channel(site, sends=True)
    out = channel.outgoing(x, None)
    flag = channel.nonfinite()
    if flag is not None and bool(flag):
        raise nonfinite_error(site.name)
    if out is x or out.dtype == x.dtype:
        return out
    return decode(out, zeroing_codec(site.config), torch.empty(x.shape, dtype=x.dtype, device=x.device))


def timed_exchanges(x: torch.Tensor, link, codec: CodecConfig) -> tuple[Callable, Callable]:
    """``(plain, compressed)``: calls that each swap ``x`` between the two ranks of ``link`` (each
    sends its x to the other and receives the other's), the compressed one encoding before and
    decoding after: the path of one boundary message, for `autotune` (``codec``: its settings, with
    no "raise": `call.propagating_codec`)."""
    if link.world != 2:
        raise ValueError(f"a point-to-point timing runs on a group of 2 ranks, got {link.world}")
    group = link.group
    peer = dist.get_global_rank(group, 1 - link.rank) if group is not None else 1 - link.rank
    got = torch.empty_like(x)
    sent = encode(x, codec)
    wire = torch.empty_like(sent)

    def swap(mine: torch.Tensor, theirs: torch.Tensor) -> None:
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer, group),
                                        dist.P2POp(dist.irecv, theirs, peer, group)])
        for work in works:
            work.wait()

    def plain() -> torch.Tensor:
        swap(x, got)
        return got

    def compressed() -> torch.Tensor:
        swap(encode(x, codec, sent), wire)
        return decode(wire, codec, got)

    return plain, compressed
