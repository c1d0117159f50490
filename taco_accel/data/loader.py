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

import bisect
import glob
import hashlib
import json
import logging
import os
from array import array
from pathlib import Path

import torch

from ..errors import CheckpointError, DataError

logger = logging.getLogger(__name__)


class Records(list):
    """A list of record dicts that remembers where each came from: ``where(i)`` is
    ``"file.jsonl:LINE"``, ``"file.json (item i)"``, ``"file.parquet (row i)"`` or the file of a
    plain-text record, for error messages. One entry per file (and the line numbers of a
    .jsonl file as a compact array)."""

    def __init__(self, records=(), origin: tuple[str, str] | None = None, lines=None) -> None:
        super().__init__(records)
        # (first index, path, kind, line numbers of a .jsonl file)
        self.segments: list[tuple[int, str, str, array | None]] = []
        if origin is not None:
            self.segments.append((0, *origin, lines))
        self._starts = [seg[0] for seg in self.segments]

    def extend_from(self, other: "Records") -> None:
        """Append ``other``'s records and their origins."""
        offset = len(self)
        self.extend(other)
        added = [(offset + start, *rest) for start, *rest in other.segments]
        self.segments += added
        self._starts += [seg[0] for seg in added]

    def _segment(self, index: int):
        pos = bisect.bisect_right(self._starts, index) - 1
        return self.segments[pos] if pos >= 0 else None

    def where(self, index: int) -> str:
        segment = self._segment(index)
        if segment is None:
            return f"record {index}"
        start, path, kind, lines = segment
        if kind == "line":
            return f"{path}:{lines[index - start]}"
        return path if kind == "file" else f"{path} ({kind} {index - start})"

    def is_plain_text(self, index: int) -> bool:
        """Whether record ``index`` is a whole plain-text file (``{"text": contents}``)."""
        segment = self._segment(index)
        return segment is not None and segment[2] == "file"


def where(records: list, index: int) -> str:
    """Where record ``index`` came from (`Records.where`), or its index in a plain list."""
    return records.where(index) if isinstance(records, Records) else f"record {index}"


def _json(text: str, path: str, line: int | None = None):
    """``json.loads(text)`` (a whole file, or its ``line``), or a DataError naming the file, the
    line and the problem."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise DataError(f"{path}:{line or error.lineno}: not valid JSON ({error.msg}, column {error.colno})") from None
    except RecursionError:
        raise DataError(f"{path}{f':{line}' if line else ''}: JSON nested too deeply to be a record") from None


def _read_jsonl(path: str) -> Records:
    rows, lines = [], array("q")
    with open(path, encoding="utf-8-sig") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            row = _json(line, path, number)
            if not isinstance(row, dict):
                raise DataError(f"{path}:{number}: expected a JSON object {{...}} per line, "
                                f"got a {type(row).__name__}")
            rows.append(row)
            lines.append(number)
    return Records(rows, (path, "line"), lines)


def read_records(path: str, columns: list[str] | None = None) -> Records:
    """The records of one local file: .jsonl / .json (a list or one object) / .parquet (only
    ``columns`` if given); any other file is one ``{"text": contents}`` record, and must be
    UTF-8 text. Malformed, binary or corrupt files raise a `DataError` that names the file
    (and the line)."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: not a regular file (a FIFO, device or folder); pass data files")
    try:
        if path.endswith(".jsonl"):
            return _read_jsonl(path)
        if path.endswith(".json"):
            with open(path, encoding="utf-8-sig") as f:
                rows = _json(f.read(), path)
            rows = rows if isinstance(rows, list) else [rows]
            bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
            if bad is not None:
                raise DataError(f"{path} (item {bad}): expected a JSON object {{...}}, "
                                f"got a {type(rows[bad]).__name__}")
            return Records(rows, (path, "item"))
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not UTF-8 text (byte {error.start}: {error.reason})") from None
    if path.endswith(".parquet"):
        return _read_parquet(path, columns)
    return Records([{"text": _read_text(path)}], (path, "file"))


def _read_parquet(path: str, columns: list[str] | None) -> Records:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
        missing = [c for c in columns or () if c not in names]
        if missing:
            raise DataError(f"{path}: no column {missing} in a file with columns {names}")
        return Records(pq.read_table(path, columns=columns).to_pylist(), (path, "row"))
    except (pa.ArrowException, OSError) as error:
        raise DataError(f"{path}: not a readable parquet file ({error}); replace it or leave it out") from None


def _read_text(path: str) -> str:
    """A plain-text file's contents: UTF-8 (a BOM is dropped), no NUL bytes, else a DataError."""
    with open(path, "rb") as f:
        data = f.read()
    nul = data.find(b"\x00")
    if nul >= 0:
        raise DataError(f"{path}: a binary file (NUL byte at {nul}), not text; pass only the data files (e.g. a "
                        "glob like folder/*.txt)")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not UTF-8 text (byte {error.start}: {error.reason}); convert it to UTF-8 or "
                        "leave it out") from None


DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")


def looks_local(source: str) -> bool:
    """Whether ``source`` names a local path (a data suffix, or a leading ``.``, ``/`` or ``~``)
    rather than a datasets name."""
    return source.endswith(DATA_SUFFIXES) or source.startswith((".", "/", "~")) or os.path.isdir(source)


def load_records(source: str, *, split: str = "train", columns: list[str] | None = None) -> Records:
    """Records from local files (a path, a folder or a glob of .jsonl / .json / .parquet /
    text) or a datasets name ``"name"`` / ``"name:config"`` (from the local datasets cache)."""
    source = os.path.expanduser(source)
    files = sorted(glob.glob(os.path.join(source, "*"))) if os.path.isdir(source) else sorted(glob.glob(source))
    files = [f for f in files if not os.path.basename(f).startswith(".") and not os.path.isdir(f)]
    if files:
        records = Records()
        for f in files:
            records.extend_from(read_records(f, columns))
        return records
    if looks_local(source):
        raise DataError(f"data source {source!r}: no such file (or an empty folder / a glob that matches nothing)")
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"data source {source!r} is not a local file and the datasets package is not installed; "
            "pass local .txt/.jsonl/.json/.parquet files or pip install datasets"
        ) from None
    name, _, config = source.partition(":")
    ds = datasets.load_dataset(name, config or None, split=split)
    return Records(ds.select_columns(columns) if columns else ds, (f"{source} (split {split})", "row"))


def load_texts(source: str | None = None, *, split: str = "train", text_field: str = "text") -> list[str]:
    """Documents from ``source``: None or ``"stdlib"`` (the shipped corpus), or what
    `load_records` reads (a text file is one document; other records give ``text_field``).
    Empty documents are dropped; a record without ``text_field``, or whose value is not text,
    raises a ValueError naming its file and line and the fields it has."""
    if source in (None, "", "stdlib"):
        from .corpus import load_documents

        return load_documents()
    records = load_records(source, split=split, columns=[text_field])
    texts = []
    for index, record in enumerate(records):
        key = "text" if text_field not in record and records.is_plain_text(index) else text_field
        if key not in record:
            raise ValueError(f"{records.where(index)}: no {text_field!r} field in a record with fields "
                             f"{sorted(record)}; name the text field (--text-field)")
        text = record[key]
        if text is not None and not isinstance(text, str):
            raise ValueError(f"{records.where(index)}: the {key!r} field is a {type(text).__name__}, not text")
        if text:
            texts.append(text)
    return texts


def split_documents(docs: list[str], val_every: int = 20) -> tuple[list[str], list[str]]:
    """(train, validation): every ``val_every``-th document goes to validation."""
    if isinstance(val_every, bool) or not isinstance(val_every, int) or val_every < 2:
        raise ValueError(f"val_every={val_every!r}: pass an int >= 2 (every val_every-th document is held out)")
    if len(docs) < 2:
        text = docs[0] if docs else ""
        cut = len(text) * (val_every - 1) // val_every
        return [text[:cut]], [text[cut:]]
    val_idx = {i for i in range(len(docs)) if i % val_every == val_every - 1} or {len(docs) - 1}
    return [d for i, d in enumerate(docs) if i not in val_idx], [docs[i] for i in sorted(val_idx)]


def tokenize(docs: list[str], tokenizer, cache_dir: str | os.PathLike | None = None) -> torch.Tensor:
    """All documents as one 1-D int32 token stream, each followed by EOS; cached on disk by a
    hash of the tokenizer and the text."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no EOS token (eos_token_id is None): documents are joined with EOS; "
                         "set tokenizer.eos_token")
    from .tokenizer import tokenizer_digest

    digest = hashlib.sha256(tokenizer_digest(tokenizer).encode())
    for d in docs:  # each length first: ["ab", "c"] and ["a", "bc"] have other EOS positions
        text = d.encode("utf-8", "replace")
        digest.update(len(text).to_bytes(8, "little"))
        digest.update(text)
    path = Path(cache_dir) / f"tokens-{digest.hexdigest()[:16]}.pt" if cache_dir else None
    cached = _read_token_cache(path) if path is not None else None
    if cached is not None:
        return cached
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


def _read_token_cache(path: Path) -> torch.Tensor | None:
    """The cached token stream at ``path`` (read without running pickled code), or None when
    there is none or it is damaged (then it is made again, with a warning)."""
    if not path.is_file():
        return None
    try:
        tokens = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # truncated, or not a file this code wrote
        logger.warning("the token cache %s is damaged (%s); tokenizing the text again", path,
                       str(error).splitlines()[0] if str(error) else type(error).__name__)
        return None
    if not (isinstance(tokens, torch.Tensor) and tokens.dtype == torch.int32 and tokens.dim() == 1):
        logger.warning("the token cache %s holds no token stream; tokenizing the text again", path)
        return None
    return tokens


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of ``n`` samples in ``epoch``: the same on every rank and machine for a seed."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def check_positive(**values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: pass a positive int")


def check_dp(dp_rank: int, dp_size: int) -> None:
    """A ValueError unless 0 <= dp_rank < dp_size (another rank would read other ranks' or no data)."""
    check_positive(dp_size=dp_size)
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank!r}: pass an int in [0, dp_size={dp_size})")


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
        check_positive(seq_len=seq_len, global_batch=global_batch)
        check_dp(dp_rank, dp_size)
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
        """The position of a checkpoint; its seed, global batch and window length must be this
        run's (a `CheckpointError` names the one that differs): the position counts global
        batches, so a run resumed on another mesh keeps micro-batch size x micro-batches x dp."""
        for key in ("seed", "global_batch", "seq_len"):
            if state[key] != getattr(self, key):
                raise CheckpointError(
                    f"the checkpoint's data {key}={state[key]} differs from this run's {getattr(self, key)}: resume "
                    "with the same --seed, --seq-len and global batch (micro-batch size x micro-batches x dp)")
        self.step = state["step"]


def eval_batches(tokens: torch.Tensor, seq_len: int, batch: int, num_batches: int, dp_rank: int = 0,
                 dp_size: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``num_batches`` global batches of validation windows, in order (this rank's
    slices). Validation text shorter than one batch is repeated, with a warning."""
    check_positive(seq_len=seq_len, batch=batch, num_batches=num_batches)
    check_dp(dp_rank, dp_size)
    if batch % dp_size:
        raise ValueError(f"batch {batch} is not divisible by dp={dp_size}")
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
