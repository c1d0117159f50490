"""Fine-tuning data: records in, padded batches with the loss on the response tokens only.

A record is one of three kinds, recognised from its fields:

- a conversation: ``{"messages": [{"role": ..., "content": ...}, ...]}``; the last message is
  the response (an assistant turn), everything before it the prompt;
- a prompt and a response: ``prompt``/``response``, ``prompt``/``completion``,
  ``instruction`` (+ ``input``)/``output`` (Alpaca), ``question``/``answer``, or the fields you name;
- plain text (``text``): every token is trained; long texts are cut into windows.

Formatting is ``"chat"`` (the tokenizer's chat template; `CHATML` when it has none),
``"plain"`` (`PLAIN_TEMPLATE` around the prompt, EOS after the response) or ``"auto"`` (chat when
the tokenizer has a template). Prompt and response are tokenized separately and concatenated,
so the boundary is exact; the labels are -100 on the prompt and on padding.

`SFTBatches` draws a seeded permutation per epoch over the examples (any number of them: the
stream wraps around) and gives dp rank r its slice of each step's global batch, as
micro-batches padded to their longest example. Every tp rank of a replica gets the same batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .loader import check_positive, check_dp, epoch_permutation, where

logger = logging.getLogger(__name__)

IGNORE = -100
PAIRS = (("prompt", "response"), ("prompt", "completion"), ("instruction", "output"), ("question", "answer"),
         ("query", "response"), ("input", "output"))
PLAIN_TEMPLATE = "### Instruction:\n{prompt}\n\n### Response:\n"
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
FORMATS = ("auto", "chat", "plain")


@dataclass(frozen=True)
class RecordFields:
    """Which fields hold the prompt, the response, a conversation or plain text (None: detect)."""

    prompt: str | None = None
    response: str | None = None
    messages: str = "messages"
    text: str = "text"
    system: str | None = None  # a system prompt for chat formatting

    def kind(self, record: dict) -> str:
        """``"messages"``, ``"pair"`` or ``"text"``, or a ValueError naming the fields it knows."""
        if not isinstance(record, dict):
            raise ValueError(f"a record must be an object with fields, got a {type(record).__name__}")
        if self.prompt or self.response:
            missing = [f for f in (self.prompt, self.response) if f and f not in record]
            if missing or not (self.prompt and self.response):
                raise ValueError(f"a record has fields {sorted(record)}; --prompt-field and --response-field "
                                 f"must both name fields of it (missing {missing or 'one of the two'})")
            return "pair"
        if self.messages in record:
            return "messages"
        if any(p in record and r in record for p, r in PAIRS):
            return "pair"
        if self.text in record:
            return "text"
        raise ValueError(f"cannot tell prompt and response apart in a record with fields {sorted(record)}: name them "
                         f"with --prompt-field/--response-field, or use {self.messages!r}, {self.text!r} or one of "
                         f"{[f'{p}/{r}' for p, r in PAIRS]}")

    def pair(self, record: dict) -> tuple[str, str]:
        if self.prompt:
            return _text(record, self.prompt), _text(record, self.response)
        prompt_key, response_key = next((p, r) for p, r in PAIRS if p in record and r in record)
        prompt = _text(record, prompt_key)
        if prompt_key == "instruction" and record.get("input"):  # Alpaca
            prompt = f"{prompt}\n\n{_text(record, 'input')}"
        return prompt, _text(record, response_key)

    def conversation(self, record: dict) -> list[dict]:
        """The record's messages, each with a text ``role`` and ``content``; the last one,
        the response, not a user or system turn."""
        messages = record[self.messages]
        if not isinstance(messages, list):
            raise ValueError(f"the {self.messages!r} field is a {type(messages).__name__}, not a list of messages")
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not all(isinstance(message.get(k), str) for k in ("role", "content")):
                fields = sorted(message) if isinstance(message, dict) else type(message).__name__
                raise ValueError(f"message {index} of {self.messages!r} ({fields}) needs text 'role' and 'content' "
                                 "fields")
        if messages and messages[-1]["role"] in ("user", "system"):
            raise ValueError(f"the last message is a {messages[-1]['role']!r} turn; it is the response the model "
                             "learns, so it must be the assistant's")
        return messages

    def text_of(self, record: dict) -> str:
        return _text(record, self.text)


def _text(record: dict, key: str) -> str:
    """``record[key]`` as text: numbers are written out; null, lists and objects raise (a null
    would otherwise train on the word "None")."""
    value = record[key]
    if value is None or isinstance(value, (list, dict)):
        raise ValueError(f"the {key!r} field is {'null' if value is None else 'a ' + type(value).__name__}, not text")
    return str(value)


def resolve_format(fmt: str, tokenizer, warn: bool = True) -> str:
    """``"chat"`` or ``"plain"``; a tokenizer without a chat template gets `CHATML` for ``"chat"``."""
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r}: use one of {FORMATS}")
    if fmt == "auto":
        return "chat" if getattr(tokenizer, "chat_template", None) else "plain"
    if fmt == "chat" and not getattr(tokenizer, "chat_template", None):
        if warn:
            logger.warning("the tokenizer has no chat template: using ChatML (saved with the exported tokenizer)")
        tokenizer.chat_template = CHATML
    return fmt


def _messages(record: dict, fields: RecordFields, kind: str) -> list[dict]:
    if kind == "messages":
        messages = list(fields.conversation(record))
    else:
        prompt, response = fields.pair(record)
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    if fields.system and (not messages or messages[0]["role"] != "system"):
        messages = [{"role": "system", "content": fields.system}] + messages
    return messages


def split_prompt_response(record: dict, tokenizer, fmt: str, fields: RecordFields) -> tuple[str, str]:
    """The prompt text (no loss) and the response text (loss) of a conversation or pair record."""
    kind = fields.kind(record)
    if fmt == "chat":
        messages = _messages(record, fields, kind)
        if len(messages) < 2:
            raise ValueError(f"a conversation needs a prompt and a response, got {len(messages)} message(s)")
        prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages, tokenize=False)
        if not full.startswith(prompt):
            raise ValueError("the chat template renders the prompt differently with and without the response; "
                             "use --format plain or a template whose generation prompt is a prefix")
        return prompt, full[len(prompt):]
    if kind == "messages":
        messages = fields.conversation(record)
        if len(messages) < 2:
            raise ValueError(f"a conversation needs a prompt and a response, got {len(messages)} message(s)")
        history = "\n".join(f"{m['role']}: {m['content']}" for m in messages[:-1])
        return PLAIN_TEMPLATE.format(prompt=history), messages[-1]["content"]
    prompt, response = fields.pair(record)
    return PLAIN_TEMPLATE.format(prompt=prompt), response


def tokenize_records(records: list[dict], tokenizer, *, fmt: str = "auto", max_len: int = 512,
                     fields: RecordFields = RecordFields(), warn: bool = True) -> list[tuple[list[int], list[int]]]:
    """``[(input_ids, labels)]``: labels are -100 on prompt tokens; text records become windows of
    ``max_len`` tokens (all trained). An example over ``max_len`` first loses the start of its
    prompt (keeping at least a quarter of ``max_len`` of it), then the end of its response; one
    left without a response token is dropped (with a warning when ``warn``)."""
    fmt = resolve_format(fmt, tokenizer, warn)
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 2:
        raise ValueError(f"max_len={max_len!r}: pass an int >= 2 (a prompt token and a response token)")
    eos, out, dropped = tokenizer.eos_token_id, [], 0
    if eos is None:
        raise ValueError("the tokenizer has no EOS token (eos_token_id is None); set tokenizer.eos_token")
    for index, record in enumerate(records):
        try:
            example = _tokenize_record(record, tokenizer, fmt, max_len, fields, eos)
        except (ValueError, KeyError, TypeError) as error:
            message = f"missing field {error}" if isinstance(error, KeyError) else str(error)
            raise ValueError(f"{where(records, index)}: {message}") from error
        if example is None:
            dropped += 1
        else:
            out.extend(example)
    if dropped and warn:
        logger.warning("dropped %d example(s) whose prompt fills all %d tokens; raise --max-len", dropped, max_len)
    if not out:
        raise ValueError("no training example left after tokenization; check the data and --max-len")
    return out


def _tokenize_record(record: dict, tokenizer, fmt: str, max_len: int, fields: RecordFields,
                     eos: int) -> list[tuple[list[int], list[int]]] | None:
    """The examples of one record (text: its windows), or None when its prompt leaves no room."""
    if fields.kind(record) == "text":
        ids = tokenizer(fields.text_of(record), add_special_tokens=True)["input_ids"] + [eos]
        return [(ids[i:i + max_len], ids[i:i + max_len]) for i in range(0, len(ids) - 1, max_len)]
    prompt, response = split_prompt_response(record, tokenizer, fmt, fields)
    prompt_ids = tokenizer(prompt, add_special_tokens=fmt == "plain")["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    if fmt == "plain":  # a chat template ends the turn itself
        response_ids.append(eos)
    room = max_len - len(response_ids)
    if len(prompt_ids) > room:  # too long: the prompt loses its start (its end leads to the response)
        prompt_ids = prompt_ids[len(prompt_ids) - max(room, max_len // 4):]
    ids = (prompt_ids + response_ids)[:max_len]
    labels = ([IGNORE] * len(prompt_ids) + response_ids)[:max_len]
    if all(label == IGNORE for label in labels):
        return None
    return [(ids, labels)]


def split_examples(examples: list, eval_fraction: float) -> tuple[list, list]:
    """(train, eval): every k-th example (k = round(1 / eval_fraction)) is held out; at least one each."""
    if not 0 < eval_fraction < 1:
        raise ValueError(f"eval_fraction={eval_fraction} must be in (0, 1)")
    if len(examples) < 2:
        raise ValueError(f"{len(examples)} example(s): too few to hold some out; pass separate eval data")
    every = max(2, round(1 / eval_fraction))
    held = {i for i in range(len(examples)) if i % every == every - 1} or {len(examples) - 1}
    return [e for i, e in enumerate(examples) if i not in held], [examples[i] for i in sorted(held)]


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int, pad_multiple: int = 1) -> dict:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (b, s), s a multiple of ``pad_multiple``."""
    longest = max(len(ids) for ids, _ in examples)
    length = -(-longest // pad_multiple) * pad_multiple
    ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), length), dtype=torch.long)
    for row, (x, y) in enumerate(examples):
        ids[row, :len(x)], labels[row, :len(y)], mask[row, :len(x)] = torch.tensor(x), torch.tensor(y), 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class SFTBatches:
    """Seeded, resumable micro-batches of one dp rank: ``batch(step)`` is a list of
    ``micro_batches`` dicts of ``micro_batch_size`` examples each."""

    def __init__(self, examples: list, micro_batch_size: int, micro_batches: int, pad_id: int, *, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0, pad_multiple: int = 1):
        if not examples:
            raise ValueError("no examples to draw batches from")
        check_positive(micro_batch_size=micro_batch_size, micro_batches=micro_batches, pad_multiple=pad_multiple)
        check_dp(dp_rank, dp_size)
        self.examples, self.pad_id, self.pad_multiple = examples, pad_id, pad_multiple
        self.micro_batch_size, self.micro_batches = micro_batch_size, micro_batches
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.global_batch = micro_batch_size * micro_batches * dp_size
        self._perms: dict[int, list[int]] = {}

    def _index(self, k: int) -> int:
        epoch, pos = divmod(k, len(self.examples))
        if epoch not in self._perms:
            self._perms = {epoch: epoch_permutation(len(self.examples), self.seed, epoch).tolist()}
        return self._perms[epoch][pos]

    def batch(self, step: int) -> list[dict]:
        per_rank = self.micro_batch_size * self.micro_batches
        start = step * self.global_batch + self.dp_rank * per_rank
        picked = [self.examples[self._index(k)] for k in range(start, start + per_rank)]
        return [collate(picked[i:i + self.micro_batch_size], self.pad_id, self.pad_multiple)
                for i in range(0, per_rank, self.micro_batch_size)]


def eval_micro_batches(examples: list, micro_batch_size: int, pad_id: int, *, dp_rank: int = 0, dp_size: int = 1,
                       pad_multiple: int = 1) -> list[dict]:
    """Every held-out example once: this dp rank's share (example i goes to rank i % dp), in micro-batches.
    Ranks may get one micro-batch fewer; callers all-reduce sums, so that is fine."""
    mine = examples[dp_rank::dp_size]
    return [collate(mine[i:i + micro_batch_size], pad_id, pad_multiple) for i in range(0, len(mine), micro_batch_size)]
