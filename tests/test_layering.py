"""The one-way flow of DESIGN.md: a layer imports only the layers below it."""

from __future__ import annotations

import ast
from pathlib import Path

import taco_accel

PACKAGE = Path(taco_accel.__file__).parent
# lower number = lower layer; data/ is a leaf used by the trainer; bench/ is a tool over all
LAYERS = {"codec": 1, "comm": 2, "tp": 3, "models": 4, "data": 4, "parallel": 5, "integrations": 6}


def imported_packages(path: Path) -> set[str]:
    """The taco_accel sub-packages a module imports, lazily imported ones included."""
    depth = len(path.relative_to(PACKAGE).parts) - 1  # package depth of the module
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: climb to the package root, then read the first name
                if node.level - 1 < depth:
                    continue  # inside its own sub-package
                parts = (node.module or "").split(".")
                names = [parts[0]] if parts[0] else [a.name for a in node.names]
            elif (node.module or "").startswith("taco_accel."):
                names = [node.module.split(".")[1]]
            else:
                continue
            found.update(names)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("taco_accel."))
    return found & set(LAYERS)


def test_no_layer_imports_a_higher_one():
    problems = []
    for layer, level in LAYERS.items():
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            for other in imported_packages(path):
                if LAYERS[other] > level or (LAYERS[other] == level and other != layer):
                    problems.append(f"{path.relative_to(PACKAGE)} ({layer}) imports {other}")
    assert not problems, "imports against the layering:\n" + "\n".join(problems)


def test_the_codec_needs_no_torch_distributed():
    for path in (PACKAGE / "codec").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.startswith("torch.distributed") for n in names), path
