"""Tokenizers that need no network: byte-level, a small BPE trained on the spot, or a local one.

Every result is a ``transformers.PreTrainedTokenizerFast``, so it saves next to an exported
model and loads back with ``AutoTokenizer.from_pretrained``. ``"byte"`` is a byte-level BPE
without merges (256 byte tokens + ``<|endoftext|>``); ``"bpe:N"`` trains a byte-level BPE of N
tokens on the training text and caches it by a hash of that text; anything else is a local
folder or file of an existing tokenizer.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Iterable

logger = logging.getLogger(__name__)

EOS = "<|endoftext|>"


def tokenizer_digest(tokenizer) -> str:
    """A sha256 of what decides the token ids: the backend tokenizer's whole serialisation
    (vocabulary, merges, normalisation, special tokens) for a fast tokenizer, else its repr."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(tokenizer)
    return hashlib.sha256(text.encode()).hexdigest()


def default_cache_dir() -> Path:
    return Path(os.environ.get("TACO_CACHE", Path.home() / ".cache" / "taco_accel"))


def _wrap(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)


def _train_bpe(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def build_tokenizer(spec: str, texts: Iterable[str] | None = None, cache_dir: str | os.PathLike | None = None):
    """A tokenizer from ``spec``: ``"byte"``, ``"bpe:N"`` (trained on ``texts``) or a local path."""
    if spec == "byte":
        return _wrap(_train_bpe([], 257))  # 256 bytes + EOS, no merges
    if spec.startswith("bpe:"):
        try:
            vocab_size = int(spec[4:])
        except ValueError:
            raise ValueError(f"tokenizer spec {spec!r}: use bpe:N with N an int, e.g. bpe:4096") from None
        if vocab_size < 257:
            raise ValueError(f"tokenizer spec {spec!r}: a byte-level BPE needs N >= 257")
        if texts is None:
            raise ValueError("a bpe:N tokenizer is trained on the training text; pass texts")
        texts = list(texts)
        digest = hashlib.sha256()
        for t in texts:
            digest.update(t.encode("utf-8", "replace"))
        path = Path(cache_dir or default_cache_dir()) / f"bpe{vocab_size}-{digest.hexdigest()[:16]}.json"
        from tokenizers import Tokenizer

        if path.is_file():
            try:
                return _wrap(Tokenizer.from_file(str(path)))
            except Exception as error:  # a truncated or foreign file: a cache, made again
                logger.warning("the tokenizer cache %s is damaged (%s); training it again", path, error)
        tok = _train_bpe(texts, vocab_size)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tok.save(str(tmp))
        os.replace(tmp, path)  # atomic: concurrent ranks never read a half-written file
        logger.info("trained a %d-token BPE, cached at %s", vocab_size, path)
        return _wrap(tok)
    if not os.path.exists(spec):
        raise ValueError(
            f"tokenizer {spec!r} is neither 'byte', 'bpe:N' nor a local path; hub downloads are "
            "not used at run time: download it first and pass its folder"
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(spec, local_files_only=True)
