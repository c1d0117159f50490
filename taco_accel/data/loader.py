"""Text in, token batches out: load texts, tokenize once (cached), pack, shard by dp rank.

Training text is packed: documents joined with EOS and cut into windows of ``seq_len + 1``
tokens (inputs are the first seq_len, labels the last seq_len), so no token is padding and
every micro-batch has the same number of loss tokens. `PackedBatches` draws a fixed,
seeded permutation of the windows per epoch; step k of the whole run takes
``global_batch`` windows, and dp rank r the r-th contiguous slice of them. Only dp shards the
data: every pp and tp rank of a replica gets the same batch. Its position (epoch, step) is
its whole state, so a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def read_records(path: str, columns: list[str] | None = None) -> list[dict]:
    """The records of one local file: .jsonl / .json (a list or one object) / .parquet (only
    ``columns`` if given); any other file is one ``{"text": contents}`` record."""
    if path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    if path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            rows = json.load(f)
        return rows if isinstance(rows, list) else [rows]
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path, columns=columns).to_pylist()
    with open(path, encoding="utf-8", errors="replace") as f:
        return [{"text": f.read()}]


def load_records(source: str, *, split: str = "train", columns: list[str] | None = None) -> list[dict]:
    """Records from local files (a path, a folder or a glob of .jsonl / .json / .parquet /
    text) or a datasets name ``"name"`` / ``"name:config"`` (from the local datasets cache)."""
    files = sorted(glob.glob(os.path.join(source, "*"))) if os.path.isdir(source) else sorted(glob.glob(source))
    if files:
        return [r for f in files if os.path.isfile(f) for r in read_records(f, columns)]
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"data source {source!r} is not a local file and the datasets package is not installed; "
            "pass local .txt/.jsonl/.json/.parquet files or pip install datasets"
        ) from None
    name, _, config = source.partition(":")
    ds = datasets.load_dataset(name, config or None, split=split)
    return list(ds.select_columns(columns) if columns else ds)


def load_texts(source: str | None = None, *, split: str = "train", text_field: str = "text") -> list[str]:
    """Documents from ``source``: None or ``"stdlib"`` (the shipped corpus), or what
    `load_records` reads (a text file is one document; other records give ``text_field``).
    Empty documents are dropped."""
    if source in (None, "", "stdlib"):
        from .corpus import load_documents

        return load_documents()
    records = load_records(source, split=split, columns=[text_field])
    return [t for t in (r[text_field] if text_field in r else r["text"] for r in records) if t]


def split_documents(docs: list[str], val_every: int = 20) -> tuple[list[str], list[str]]:
    """(train, validation): every ``val_every``-th document goes to validation."""
    if len(docs) < 2:
        text = docs[0] if docs else ""
        cut = len(text) * (val_every - 1) // val_every
        return [text[:cut]], [text[cut:]]
    val_idx = {i for i in range(len(docs)) if i % val_every == val_every - 1} or {len(docs) - 1}
    return [d for i, d in enumerate(docs) if i not in val_idx], [docs[i] for i in sorted(val_idx)]


def tokenize(docs: list[str], tokenizer, cache_dir: str | os.PathLike | None = None) -> torch.Tensor:
    """All documents as one 1-D int32 token stream, each followed by EOS; cached on disk by a
    hash of the tokenizer and the text."""
    digest = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode() if hasattr(tokenizer, "backend_tokenizer") else repr(tokenizer).encode())
    for d in docs:
        digest.update(d.encode("utf-8", "replace"))
    path = Path(cache_dir) / f"tokens-{digest.hexdigest()[:16]}.pt" if cache_dir else None
    if path is not None and path.exists():
        return torch.load(path)
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos)
    tokens = torch.tensor(ids, dtype=torch.int32)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save(tokens, tmp)
        os.replace(tmp, path)
    return tokens


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of ``n`` samples in ``epoch``: the same on every rank and machine for a seed."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def _windows(tokens: torch.Tensor, idx: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) of the windows ``idx``: seq_len + 1 tokens from ``idx * seq_len``, shifted."""
    w = tokens[idx.unsqueeze(1) * seq_len + torch.arange(seq_len + 1)].long()  # (b, s+1)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


class PackedBatches:
    """Seeded, resumable batches of packed windows for one dp rank.

    ``next()`` returns ``(input_ids, labels)``, each ``(global_batch // dp_size, seq_len)`` int64.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, global_batch: int, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0):
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} is not divisible by dp={dp_size}")
        self.windows = (tokens.numel() - 1) // seq_len
        if self.windows < global_batch:
            raise ValueError(
                f"the text has {tokens.numel()} tokens: {self.windows} windows of {seq_len + 1}, fewer than "
                f"one global batch ({global_batch}); use more text, a shorter seq_len or a smaller batch"
            )
        self.tokens, self.seq_len, self.global_batch = tokens, seq_len, global_batch
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.steps_per_epoch = self.windows // global_batch
        self.step = 0  # batches drawn so far, over all epochs
        self._perm_epoch, self._perm = -1, None

    def _batch_indices(self, step: int) -> torch.Tensor:
        epoch, k = divmod(step, self.steps_per_epoch)
        if epoch != self._perm_epoch:
            self._perm, self._perm_epoch = epoch_permutation(self.windows, self.seed, epoch), epoch
        per_rank = self.global_batch // self.dp_size
        start = k * self.global_batch + self.dp_rank * per_rank
        return self._perm[start:start + per_rank]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of ``step`` (0-based) for this rank, without moving the position."""
        return _windows(self.tokens, self._batch_indices(step), self.seq_len)

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.batch(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed, "global_batch": self.global_batch, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "global_batch", "seq_len"):
            if state[key] != getattr(self, key):
                raise ValueError(f"the checkpoint's data {key}={state[key]} differs from this run's {getattr(self, key)}")
        self.step = state["step"]


def eval_batches(tokens: torch.Tensor, seq_len: int, batch: int, num_batches: int, dp_rank: int = 0,
                 dp_size: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``num_batches`` global batches of validation windows, in order (this rank's
    slices). Validation text shorter than one batch is repeated, with a warning."""
    windows = (tokens.numel() - 1) // seq_len
    if windows < 1:
        raise ValueError(f"the validation text has {tokens.numel()} tokens, fewer than one window of {seq_len + 1}")
    if windows < batch:
        logger.warning("the validation text holds %d windows of %d tokens, fewer than one batch (%d): "
                       "repeating them", windows, seq_len, batch)
    num_batches = max(1, min(num_batches, windows // batch))
    per_rank = batch // dp_size
    out = []
    for k in range(num_batches):
        idx = torch.arange(k * batch + dp_rank * per_rank, k * batch + (dp_rank + 1) * per_rank) % windows
        out.append(_windows(tokens, idx, seq_len))
    return out
