"""The offline text corpus: Python standard library source, shipped in the repository.

``stdlib_corpus.txt.gz`` (about 1.5 MB of text, 0.4 MB on disk) holds a fixed selection of
top-level modules of CPython's standard library (PSF License, see ``NOTICE``), one document per
module separated by ``DOC_SEPARATOR``. It is real, varied text (code, docstrings, comments)
that every machine can train on without a network. ``python -m taco_accel.data.corpus``
regenerates it from the running interpreter's own stdlib.
"""

from __future__ import annotations

import gzip
import os
import sysconfig
from pathlib import Path

CORPUS_PATH = Path(__file__).with_name("stdlib_corpus.txt.gz")
DOC_SEPARATOR = "\n\x1e\n"  # ASCII record separator between documents
MAX_FILE_BYTES = 120_000
BUDGET_BYTES = 1_500_000


def load_documents(path: str | os.PathLike = CORPUS_PATH) -> list[str]:
    """The shipped corpus as a list of documents (one per stdlib module)."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [d for d in f.read().split(DOC_SEPARATOR) if d.strip()]


def build_corpus(path: str | os.PathLike = CORPUS_PATH, budget: int = BUDGET_BYTES) -> int:
    """Write the corpus from this interpreter's stdlib: top-level modules in name order,
    skipping files over MAX_FILE_BYTES, until ``budget`` bytes. Returns the bytes written."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs, total = [], 0
    for file in sorted(stdlib.glob("*.py")):
        text = file.read_text(encoding="utf-8", errors="replace")
        if len(text) > MAX_FILE_BYTES or file.name.startswith("_"):
            continue
        if total + len(text) > budget:
            break
        docs.append(f"# {file.name}\n{text}")
        total += len(text)
    with gzip.GzipFile(path, "wb", mtime=0) as f:  # mtime=0: the same bytes on every rebuild
        f.write(DOC_SEPARATOR.join(docs).encode("utf-8"))
    return total


if __name__ == "__main__":
    print(f"wrote {build_corpus()} bytes of text to {CORPUS_PATH}")
