"""The communication figures of the models a `taco_accel.Accelerator` prepared: what their
collectives sent (`compression_stats`, for ``accelerator.log``) and each site's compression
decision (`compression_decisions`, for a run's record). The totals and decisions are
collectives over every process."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.stats import pop_ledgers
from ..parallel import ModelParts
from ..parallel.transfer import host_numbers


def compression_stats(ledgers: list, device: torch.device) -> dict[str, float]:
    """What the sites of ``ledgers`` sent on all ranks since their last pop (then reset):
    ``comm/bytes_sent``, ``comm/bytes_saved`` (against plain collectives) and
    ``comm/compression`` (plain / sent). A collective (the sums are over every process)."""
    stats = pop_ledgers(ledgers).values()
    totals = host_numbers([sum(s.bytes_sent for s in stats), sum(s.bytes_uncompressed for s in stats)], device)
    dist.all_reduce(totals)
    sent, plain = totals.tolist()
    return {"comm/bytes_sent": sent, "comm/bytes_saved": plain - sent,
            "comm/compression": plain / sent if sent else 1.0}


def compression_decisions(prepared: list[ModelParts]) -> dict[str, dict]:
    """Every communication site of ``prepared``, over all pipeline stages (every process's): its
    mode and, for ``"auto"`` sites that have run, the timing decision (`SiteTable.decisions`).
    JSON-ready. A collective."""
    mine = {}
    for parts in prepared:
        for table in parts.site_tables():
            mine.update(table.decisions())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {site: record for part in everyone for site, record in part.items()}
