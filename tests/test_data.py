"""The offline corpus, the tokenizers and the packed, dp-sharded, resumable batches."""

from __future__ import annotations

import json

import pytest
import torch

from taco_accel.data import PackedBatches, build_tokenizer, eval_batches, load_texts, split_documents, tokenize
from taco_accel.data.corpus import CORPUS_PATH


def test_shipped_corpus_is_small_and_real_text():
    assert CORPUS_PATH.stat().st_size < 2 * 2**20
    docs = load_texts()
    assert len(docs) > 20 and sum(map(len, docs)) > 1_000_000
    train, val = split_documents(docs)
    assert len(train) + len(val) == len(docs) and val and not set(val) & set(train)


def test_byte_tokenizer_round_trips_any_text():
    tok = build_tokenizer("byte")
    text = "def f(x):\n    return x ** 2  # é → ∑"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(tok) == 257 and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_bpe_is_trained_once_and_cached(tmp_path):
    texts = load_texts()[:5]
    first = build_tokenizer("bpe:400", texts, tmp_path)
    assert len(first) == 400 and len(list(tmp_path.glob("bpe400-*.json"))) == 1
    again = build_tokenizer("bpe:400", texts, tmp_path)
    assert again(texts[0])["input_ids"] == first(texts[0])["input_ids"]
    with pytest.raises(ValueError, match="bpe:N"):
        build_tokenizer("bpe:lots", texts)


def test_local_files_and_token_cache(tmp_path):
    (tmp_path / "a.txt").write_text("hello world")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "second doc"}) + "\n" + json.dumps({"text": "third"}) + "\n")
    docs = load_texts(str(tmp_path))
    assert docs == ["hello world", "second doc", "third"]
    tok = build_tokenizer("byte")
    tokens = tokenize(docs, tok, tmp_path / "cache")
    assert tokens.numel() == len("hello world") + len("second doc") + len("third") + 3  # + EOS each
    assert torch.equal(tokenize(docs, tok, tmp_path / "cache"), tokens)  # from the cache
    with pytest.raises(ValueError, match="tokenizer"):
        build_tokenizer(str(tmp_path / "missing"))


def test_batches_shard_the_global_batch_over_dp_and_resume():
    tokens = torch.arange(10_000, dtype=torch.int32)
    single = PackedBatches(tokens, seq_len=16, global_batch=8, seed=3)
    shards = [PackedBatches(tokens, seq_len=16, global_batch=8, dp_rank=r, dp_size=2, seed=3) for r in range(2)]
    for step in range(3):
        inputs, labels = single.batch(step)
        assert torch.equal(labels[:, :-1], inputs[:, 1:])  # next-token targets
        assert torch.equal(torch.cat([s.batch(step)[0] for s in shards]), inputs)
    next(single), next(single)
    state = single.state_dict()
    fresh = PackedBatches(tokens, seq_len=16, global_batch=8, seed=3)
    fresh.load_state_dict(state)
    assert torch.equal(next(fresh)[0], next(single)[0])
    with pytest.raises(ValueError, match="global_batch"):
        PackedBatches(tokens, seq_len=16, global_batch=4, seed=3).load_state_dict(state)


def test_epochs_reshuffle_and_eval_batches_are_fixed():
    tokens = torch.arange(16 * 8 + 1, dtype=torch.int32)
    b = PackedBatches(tokens, seq_len=16, global_batch=4)
    assert b.steps_per_epoch == 2
    epoch0 = torch.cat([b.batch(0)[0], b.batch(1)[0]])
    epoch1 = torch.cat([b.batch(2)[0], b.batch(3)[0]])
    assert sorted(epoch0[:, 0].tolist()) == sorted(epoch1[:, 0].tolist())  # the same windows
    val = eval_batches(tokens, 16, batch=4, num_batches=10, dp_rank=1, dp_size=2)
    assert len(val) == 2 and val[0][0].shape == (2, 16) and val[0][0][0, 0] == 32
    with pytest.raises(ValueError, match="fewer than one global batch"):
        PackedBatches(tokens[:40], seq_len=16, global_batch=4)


def test_short_validation_text_is_repeated():
    tokens = torch.arange(3 * 16 + 1, dtype=torch.int32)  # 3 windows, batch of 4
    (inputs, labels), = eval_batches(tokens, 16, batch=4, num_batches=2)
    assert inputs.shape == (4, 16) and torch.equal(inputs[3], inputs[0])


def test_token_cache_keys_on_document_boundaries(tmp_path):
    tok = build_tokenizer("byte")
    first = tokenize(["ab", "c"], tok, tmp_path)
    second = tokenize(["a", "bc"], tok, tmp_path)  # the same characters, EOS elsewhere
    assert len(list(tmp_path.glob("tokens-*.pt"))) == 2
    assert not torch.equal(first, second) and second[1] == tok.eos_token_id


def test_batch_arguments_out_of_range_raise():
    tokens = torch.arange(1000, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"dp_rank=2: pass an int in \[0, dp_size=2\)"):
        PackedBatches(tokens, seq_len=16, global_batch=4, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="seq_len=0: pass a positive int"):
        PackedBatches(tokens, seq_len=0, global_batch=4)
    with pytest.raises(ValueError, match="dp_rank=-1"):
        eval_batches(tokens, 16, batch=4, num_batches=1, dp_rank=-1, dp_size=2)
    with pytest.raises(ValueError, match="val_every=1"):
        split_documents(["a", "b"], val_every=1)
