"""The one-way flow of ARCHITECTURE.md: a layer imports only the layers below it; no module imports
another's private names; no import cycle between modules."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import taco_accel

PACKAGE = Path(taco_accel.__file__).parent
# lower number = lower layer; errors.py is the leaf every layer raises from; data/ is a leaf used by the trainer;
# training/ (the application: the loop, Trainer, Finetuner, command lines) is the top; bench/ is a tool over all;
# upstream/ (the adapters of upstream libraries' private names) is a leaf above errors, for any layer
LAYERS = {"errors": 0, "upstream": 0.5, "codec": 1, "comm": 2, "tp": 3, "models": 4, "data": 4, "parallel": 5,
          "integrations": 6, "training": 7}


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


# --- module-level imports: private names, cycles ------------------------------------------------


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def modules() -> dict[str, Path]:
    """Every taco_accel module by dotted name (a package by the name of its ``__init__``)."""
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def is_package(name: str) -> bool:
    return modules()[name].name == "__init__.py"


@functools.cache
def taco_imports(name: str) -> tuple[tuple[str, str | None, str | None], ...]:
    """``(source, imported, alias)`` for every import of a taco_accel module in module ``name``,
    lazy ones (inside functions) included: ``from source import imported as alias``, or
    ``(source, None, None)`` for ``import source``. Relative imports are resolved."""
    path, found = modules()[name], []
    package = name if is_package(name) else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            if source.split(".")[0] == "taco_accel":
                found.extend((source, a.name, a.asname or a.name) for a in node.names)
        elif isinstance(node, ast.Import):
            found.extend((a.name, None, None) for a in node.names if a.name.split(".")[0] == "taco_accel")
    return tuple(found)


def test_no_private_name_imported_from_another_module():
    """A name with one leading underscore is its module's own: what another module needs is public."""
    problems = []
    for name in modules():
        for source, imported, _ in taco_imports(name):
            private = imported and imported.startswith("_") and not imported.startswith("__")
            if private and f"{source}.{imported}" not in modules():
                problems.append(f"{name} imports {imported} from {source}")
    assert not problems, "private names imported across modules:\n" + "\n".join(problems)


def providers(source: str, imported: str | None) -> set[str]:
    """The modules that ``from source import imported`` (``import source``: None) depends on: a
    module itself; through a package, the module that defines the name (following the
    package's re-exports), or for the whole package every module it re-exports."""
    if imported is not None and f"{source}.{imported}" in modules():
        source, imported = f"{source}.{imported}", None  # a submodule
    if source not in modules():
        return set()
    if not is_package(source):
        return {source}
    reexports = [(s, n, a) for s, n, a in taco_imports(source) if s.startswith(source)]
    if imported is None:
        return {source}.union(*(providers(s, n) for s, n, _ in reexports))
    for s, n, alias in reexports:
        if alias == imported:
            return providers(s, n)
    return {source}  # defined in the package's __init__ itself


def dependencies(name: str) -> set[str]:
    """The modules ``name`` imports; a package's imports of its own contents (re-exports) are not edges."""
    found = set()
    for source, imported, _ in taco_imports(name):
        if is_package(name) and source.startswith(name):
            continue
        found |= providers(source, imported)
    return found - {name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path whose last node is its first, or None."""
    state: dict[str, str] = {}  # "open" while on the current path, then "done"
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_between_modules():
    """Module imports form no cycle, lazy imports counted: a lazy import that breaks a cycle at
    import time still ties the two modules into one."""
    cycle = find_cycle({name: dependencies(name) for name in modules()})
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
