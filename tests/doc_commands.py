"""The commands and snippets of the user documentation, read from the pages themselves.

`pages` are the pages a user reads (README.md, ARCHITECTURE.md, recipes/README.md, docs/*.md);
`blocks` returns a page's fenced code blocks, `commands` the shell commands of a ``bash`` block
(one a line, a trailing backslash continues it, ``#`` starts a comment). A test that runs a
documented command takes it from here (`documented`), so that the page and the test cannot
drift apart: tests/test_recipes.py and tests/test_finetune.py launch the recipes' CPU commands
this way, tests/test_docs.py checks every other one.

A page marks a block for tests/test_docs.py with an HTML comment on the line before its fence
(invisible on GitHub): ``<!-- test: run -->`` runs a python block as it is; ``<!-- test: run ARGS
-->`` before a one-command bash block runs that command with ARGS appended (flags that only make
it shorter, such as ``--steps 2``).
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w*)\s*$")
MARK = re.compile(r"^<!-- test: (.*?) -->$")


def pages() -> list[str]:
    """The pages whose commands and snippets are checked, relative to the repository."""
    docs = sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))
    return ["README.md", "ARCHITECTURE.md", "recipes/README.md", *docs]


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    mark: str | None  # the `<!-- test: ... -->` comment's text on the line before the fence

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


@dataclass(frozen=True)
class Command:
    block: Block
    line: int
    text: str  # as written, continuations joined, the comment dropped
    words: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{self.block.page}:{self.line}"


def blocks(page: str) -> list[Block]:
    """Every fenced block of ``page`` that names a language (``bash``, ``python``, ``yaml``, ...)."""
    lines = (ROOT / page).read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"{page}:{start + 1}: a fenced block that never closes")
        mark = MARK.match(lines[start - 1]) if start else None
        if fence.group(1):
            out.append(Block(page, start + 1, fence.group(1), "\n".join(body), mark.group(1) if mark else None))
        i += 1
    return out


def commands(block: Block) -> list[Command]:
    """The shell commands of a bash block: one a line, ``\\`` at a line's end continues it."""
    out, pending, first = [], "", None
    for offset, line in enumerate(block.text.splitlines()):
        if first is None:
            first = block.line + 1 + offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text, pending = pending + line, ""
        words = shlex.split(text, comments=True)
        if words:
            out.append(Command(block, first, shlex.join(words), tuple(words)))
        first = None
    return out


PROGRAMS = ("accelerate", "torchrun", "python", "python3", "pytest", "bash", ".venv-oldest/bin/python")
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")


def inline_commands(page: str) -> list[Command]:
    """The complete commands a page's prose quotes in backticks (a program of `PROGRAMS` with a
    script, ``-m MODULE`` or a test file): `python -m taco_accel.bench.fidelity`, ..."""
    out, fenced = [], False
    for number, line in enumerate((ROOT / page).read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        if fenced or line.startswith(("```", "    ")):
            continue
        for span in INLINE.findall(line):
            try:
                words = shlex.split(span)
            except ValueError:
                continue
            if "<" in span or "..." in span:  # a pattern (`python -m taco_accel.bench.<name>`), not a command
                continue
            if words and words[0] in PROGRAMS and any(w == "-m" or w.endswith((".py", ".sh")) for w in words[1:]):
                out.append(Command(Block(page, number, "inline", span, None), number, shlex.join(words), tuple(words)))
    return out


def script_commands() -> list[Command]:
    """The commands the recipes', the examples' and the launch configs' own headers show (a
    docstring line indented 4 spaces, a YAML comment ``#   ``), which ``--help`` and a reader of
    the file see."""
    out = []
    files = [*sorted((ROOT / "recipes").glob("*.py")), *sorted((ROOT / "examples").glob("*.py")),
             *sorted((ROOT / "recipes/configs").glob("*.yaml"))]
    for path in files:
        page = path.relative_to(ROOT).as_posix()
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            line = re.sub(r"^(#   |    )", "", lines[i], count=1) if lines[i].startswith(("#   ", "    ")) else ""
            start = i
            if line.split(" ", 1)[0] in PROGRAMS and not line.startswith("python -c"):
                while line.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line.rstrip()[:-1] + " " + re.sub(r"^#?\s*", "", lines[i])
                words = shlex.split(line, comments=True)
                out.append(Command(Block(page, start + 1, "header", line, None), start + 1, shlex.join(words), tuple(words)))
            i += 1
    return out


def every_block(lang: str | None = None) -> list[Block]:
    return [b for page in pages() for b in blocks(page) if lang is None or b.lang == lang]


def every_command() -> list[Command]:
    """Every command of every page: its bash blocks', then those its prose quotes."""
    return [c for b in every_block("bash") for c in commands(b)] + [c for p in pages() for c in inline_commands(p)]


def documented(command: str) -> list[str]:
    """``command`` as an argv that runs from any folder with this interpreter (``accelerate
    launch`` as ``python -m accelerate.commands.launch``, the repository's files as absolute
    paths), after checking that a page documents it exactly (comments aside): a test that runs a
    documented command names it with this, so that a change to the page fails the test instead
    of leaving it running a command no page shows."""
    words = tuple(shlex.split(command))
    if not any(c.words == words for c in every_command()):
        raise AssertionError(f"no page documents {command!r}: the docs changed; run what they show now")
    if words[:2] == ("accelerate", "launch"):
        head, rest = [sys.executable, "-m", "accelerate.commands.launch"], words[2:]
    elif words[0] in ("python", "python3"):
        head, rest = [sys.executable], words[1:]
    else:
        head, rest = [], words
    return head + [str(ROOT / w) if (ROOT / w).is_file() else w for w in rest]
