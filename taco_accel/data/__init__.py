"""Data for the recipes: the offline corpus, tokenizers, packed and dp-sharded batches."""

from .corpus import load_documents
from .loader import PackedBatches, eval_batches, load_texts, split_documents, tokenize
from .tokenizer import build_tokenizer

__all__ = ["PackedBatches", "build_tokenizer", "eval_batches", "load_documents", "load_texts", "split_documents", "tokenize"]
