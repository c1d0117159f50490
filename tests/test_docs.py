"""Every command and snippet of the user documentation, checked (issue 58): the pages'
(`doc_commands.pages`), and the commands the recipes', examples' and launch configs' headers show.

A bash command is checked against what it runs, without running it: ``accelerate launch`` and
``torchrun`` against their own argument parsers and the launch config it names (loaded by
Accelerate, its sizes handed to the script as ``accelerate launch`` hands them); a script or a
``python -m taco_accel...`` module against its real argument parser (the script runs up to its
``parse_args``, which stops it); a recipe's command further against the run it builds: its
settings (`TrainConfig` / `FinetuneConfig`), its mesh on the launch's processes, and the model
on that mesh (the tp degree against the heads, pipeline stages against the layers), GPU-only
commands included; ``pytest`` against the test files and names it gives; the set-up scripts
against the options they accept. A python block is compiled, each name it imports resolved, each
``taco_accel`` attribute it reads found and each call of a taco_accel callable bound to its
signature (a renamed keyword fails). Marked blocks run (doc_commands: ``<!-- test: run -->``):
the examples as one process on the CPU, snippets on a tiny model. The CPU recipes' commands run
in tests/test_recipes.py and tests/test_finetune.py, which take them from the pages.

Beside them: every relative link resolves (file and heading), the README stays short and free of
test names, each docs/ page starts with an example, the troubleshooting page names every
exception class the package raises, and the support table is the entry matrix's own list of cells
(`support_table`; ``python tests/test_docs.py --write`` rewrites it in docs/support.md).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import contextlib
import importlib
import inspect
import io
import os
import re
import runpy
import shlex
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from doc_commands import ROOT, Block, Command, blocks, commands, every_block, every_command, pages, script_commands

PYTHONS = ("python", "python3", ".venv-oldest/bin/python")
# the config.json of each hub checkpoint a page names (the tests reach no hub): what the layout needs
HUB_CONFIGS = {
    "Qwen/Qwen2.5-7B-Instruct": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944,
                                     num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                     vocab_size=152064),
    "openai-community/gpt2-large": dict(model_type="gpt2", n_embd=1280, n_layer=36, n_head=20, vocab_size=50257),
    "meta-llama/Llama-3.1-8B-Instruct": dict(model_type="llama", hidden_size=4096, intermediate_size=14336,
                                             num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                             vocab_size=128256),
}
PYTEST_OPTIONS = {"-q": 0, "-x": 0, "-v": 0, "-s": 0, "-rf": 0, "-n": 1, "--dist": 1, "-k": 1, "-m": 1}


# -- a command, checked against what it runs ------------------------------------------------------

@dataclass
class Launch:
    """What a launcher hands the script: its processes and the environment of its sizes."""

    world: int = 1
    env: dict[str, str] = field(default_factory=dict)


class _Parsed(BaseException):  # not an Exception: a script's own `except Exception` lets it through
    def __init__(self, namespace: argparse.Namespace) -> None:
        self.namespace = namespace


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """``values`` set, and the rank variables of an enclosing launch unset, for the block's length."""
    saved = dict(os.environ)
    for name in [n for n in os.environ if n.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_",
                                                         "ACCELERATE_USE_PARALLELISM", "PARALLELISM_CONFIG"))]:
        del os.environ[name]
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _users_files(args: list[str]):
    """A scratch folder as the working directory: the repository's folders (links), and an empty
    file for each data file the command names that the repository has not (``--data train.jsonl``:
    the user's own)."""
    saved = os.getcwd()
    with tempfile.TemporaryDirectory() as scratch:
        for entry in ROOT.iterdir():  # not the package: a path entry of "" must not import it from here
            if not entry.name.startswith(".") and entry.name != "taco_accel":
                Path(scratch, entry.name).symlink_to(entry)
        for word in args:
            if re.search(r"\.(jsonl|json|txt|parquet)$", word) and not (ROOT / word).exists():
                Path(scratch, word).parent.mkdir(parents=True, exist_ok=True)
                Path(scratch, word).touch()
        os.chdir(scratch)
        try:
            yield
        finally:
            os.chdir(saved)


def parsed(run, argv: list[str]) -> argparse.Namespace:
    """The namespace the first ``ArgumentParser.parse_args`` of ``run()`` returns with ``sys.argv``
    = ``argv`` (``run`` stops there), or an AssertionError with the parser's complaint."""
    original = argparse.ArgumentParser.parse_args

    def stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    saved_argv, err = sys.argv, io.StringIO()
    argparse.ArgumentParser.parse_args = stop
    sys.argv = list(argv)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            run()
    except _Parsed as done:
        return done.namespace
    except SystemExit as exit_:
        last = (err.getvalue().strip().splitlines() or [""])[-1]
        raise AssertionError(f"{' '.join(argv)}: refused by its argument parser (status {exit_.code}): {last}") from None
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv = saved_argv
    raise AssertionError(f"{' '.join(argv)} ran to its end without parsing a command line")


def parse_with(parser: argparse.ArgumentParser, args: list[str], what: str) -> argparse.Namespace:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(args)
    except SystemExit:
        raise AssertionError(f"{what} {' '.join(args)}: {err.getvalue().strip()}") from None


def check_command(words: list[str]) -> None:
    """``words`` checked against what they run; a ``$VARIABLE`` stands for a number the user gives
    (``--machine_rank $NODE_RANK``)."""
    words = ["0" if re.fullmatch(r"\$\w+", w) else w for w in words]
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    program, args = words[0], words[1:]
    if program == "accelerate" and args[:1] == ["launch"]:
        return check_accelerate_launch(args[1:])
    if program == "torchrun":
        return check_torchrun(args)
    if program in PYTHONS:
        return check_python(args, Launch())
    if program == "pytest":
        return check_pytest(args)
    if program == "bash":
        return check_bash(args, env)
    if program == "pip" and args[:1] == ["install"]:
        return  # a third-party package: nothing of ours to check
    raise AssertionError(f"no check for a command of {program!r}: teach tests/test_docs.py one")


def check_accelerate_launch(args: list[str]) -> None:
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    ns = parse_with(launch_command_parser(), args, "accelerate launch")
    processes, distributed, env = ns.num_processes, ns.multi_gpu, {}
    if ns.config_file:
        assert (ROOT / ns.config_file).is_file(), f"no launch config {ns.config_file}"
        config = load_config_from_file(str(ROOT / ns.config_file))  # Accelerate refuses unknown keys
        processes = processes or config.num_processes
        distributed = distributed or str(config.distributed_type).endswith("MULTI_GPU")
        if config.parallelism_config:  # what accelerate launch exports from the block
            env["ACCELERATE_USE_PARALLELISM_CONFIG"] = "true"
            env.update({key.upper(): str(value) for key, value in config.parallelism_config.items()})
        if config.use_cpu:
            env["ACCELERATE_USE_CPU"] = "true"
    # without --multi_gpu (or a config that says so) Accelerate's simple launcher starts one process
    check_script(ns.training_script, ns.training_script_args, Launch(processes or 1 if distributed else 1, env))


def check_torchrun(args: list[str]) -> None:
    from torch.distributed.run import get_args_parser

    ns = parse_with(get_args_parser(), args, "torchrun")
    world = int(ns.nproc_per_node) * int(str(ns.nnodes).split(":")[-1])
    check_script(ns.training_script, ns.training_script_args, Launch(world))


def check_python(args: list[str], launch: Launch) -> None:
    if args[:1] == ["-m"]:
        module, rest = args[1], args[2:]
        if module == "pytest":
            return check_pytest(rest)
        assert module.startswith("taco_accel."), f"python -m {module}: not a module of taco_accel"
        parsed(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True), [module, *rest])
        return
    check_script(args[0], args[1:], launch)


def recipe_main(source: str) -> tuple[str, str] | None:
    """``(module, family)`` of a recipe script: the taco_accel command line whose ``main`` it calls."""
    tree = ast.parse(source)
    modules = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
               and n.module in ("taco_accel.training.cli", "taco_accel.training.finetune_cli")
               and any(a.name == "main" for a in n.names)]
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == "main" and n.args and isinstance(n.args[0], ast.Constant)]
    return (modules[0], calls[0].args[0].value) if modules and calls else None


def takes_a_command_line(source: str) -> bool:
    return "argparse" in source or recipe_main(source) is not None


def check_script(path: str, args: list[str], launch: Launch) -> None:
    script = ROOT / path
    assert script.is_file(), f"no script {path}"
    source = script.read_text()
    if not takes_a_command_line(source):
        assert not args, f"{path} reads no command line, yet is given {args}"
        return
    env = {"WORLD_SIZE": str(launch.world), **launch.env}
    with _environment(env), _users_files(args):
        ns = parsed(lambda: runpy.run_path(str(script), run_name="__main__"), [path, *args])
        recipe = recipe_main(source)
        if recipe and recipe[0] == "taco_accel.training.cli":
            check_pretrain(recipe[1], ns)
        elif recipe:
            check_finetune(recipe[1], ns)


def check_pretrain(family: str, ns: argparse.Namespace) -> None:
    """The run the recipe builds: its settings, its mesh on the launch's processes, the model on it."""
    from taco_accel.training.cli import config_from_args
    from taco_accel.training.presets import model_config
    from taco_accel.training.trainer import requested_dims

    config = config_from_args(family, ns)
    dims = requested_dims(config.pp, config.dp, config.tp, config.dp_mode)
    stages = dims.pp * (config.stages_per_rank or 1)
    check_layout(model_config(family, config.preset, vocab_size=384, max_positions=config.seq_len), dims.tp, stages)


def check_finetune(family: str, ns: argparse.Namespace) -> None:
    from transformers import AutoConfig

    from taco_accel.models.tiny import tiny_config
    from taco_accel.training.finetune_cli import config_from_args
    from taco_accel.training.trainer import requested_dims

    config = config_from_args(family, ns)
    dims = requested_dims(None, config.dp, config.tp, None)
    if ns.model == "tiny":
        model = tiny_config(family)
    elif ns.model in HUB_CONFIGS:
        values = dict(HUB_CONFIGS[ns.model])
        model = AutoConfig.for_model(values.pop("model_type"), **values)
    elif ns.model.startswith("path/to/"):  # a placeholder for the user's own checkpoint: shapes unknown
        return
    else:
        assert (ROOT / ns.model).is_dir(), f"--model {ns.model}: name a checkpoint of HUB_CONFIGS or a folder"
        model = AutoConfig.from_pretrained(ROOT / ns.model)
    check_layout(model, dims.tp, 1)


def check_layout(config, tp: int, stages: int) -> None:
    """The model of ``config`` splits over ``tp`` ranks (every shard of a layer) and its layers
    over ``stages`` pipeline stages: the checks `parallelize` and `apply_pp` make first."""
    from taco_accel.models.plan import plan_for
    from taco_accel.models.rewrite import check_tp
    from taco_accel.parallel.pipeline import split_layers

    model = one_layer(config)
    check_tp(model, plan_for(model), tp)
    if stages > 1:
        split_layers(config.num_hidden_layers, stages)


def one_layer(config):
    """The causal LM of ``config`` with one decoder layer, on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    values = config.to_dict()
    values.pop("layer_types", None)  # one per layer: rebuilt for the one layer
    values["n_layer" if "n_layer" in values else "num_hidden_layers"] = 1
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config.__class__(**values))


def check_pytest(args: list[str]) -> None:
    i = 0
    while i < len(args):
        word = args[i]
        if word.startswith("-"):
            assert word in PYTEST_OPTIONS, f"pytest option {word}: not one the pages use (PYTEST_OPTIONS)"
            i += 1 + PYTEST_OPTIONS[word]
            continue
        path, _, name = word.partition("::")
        assert (ROOT / path).is_file(), f"no test file {path}"
        if name:
            defined = {n.name for n in ast.walk(ast.parse((ROOT / path).read_text()))
                       if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
            assert name.split("[")[0] in defined, f"{path} defines no {name}"
        i += 1


def check_bash(args: list[str], env: dict[str, str]) -> None:
    script = ROOT / args[0]
    assert script.is_file(), f"no script {args[0]}"
    source = script.read_text()
    options = set(re.findall(r"^\s*(--[\w-]+)\)", source, re.M))
    rest = args[1:]
    for i, word in enumerate(rest):
        if word.startswith("--"):
            assert word in options, f"{args[0]} takes no {word} (its options: {sorted(options)})"
            if word == "--stack":
                assert (ROOT / "scripts/stacks" / f"{rest[i + 1]}.txt").is_file(), f"no stack {rest[i + 1]}"
    for name in env:
        assert re.search(rf"\${{?{name}\b", source), f"{args[0]} reads no {name}"


DOC_COMMANDS = every_command() + script_commands()


@pytest.mark.parametrize("command", DOC_COMMANDS, ids=[f"{c.where} {c.text[:60]}" for c in DOC_COMMANDS])
def test_every_documented_command_fits_what_it_runs(command: Command):
    try:
        check_command(list(command.words))
    except AssertionError as error:
        raise AssertionError(f"{command.where}: {command.text}\n{error}") from None
    except Exception as error:  # the library refused the run the command builds: the page is wrong
        raise AssertionError(f"{command.where}: {command.text}\n{type(error).__name__}: {error}") from None



REFUSED_COMMANDS = [  # what the checks must refuse: each would fail a user
    "python recipes/qwen_pretrain.py --presets 0.5b",                                            # a renamed flag
    "accelerate launch --config_file recipes/configs/node_tp8.yaml recipes/qwen_pretrain.py --preset 1.5b",  # 12 heads
    "torchrun --nproc-per-node 8 recipes/gpt_pretrain.py --preset nano --pp 8",                 # 4 layers, 8 stages
    "accelerate launch --config_file recipes/configs/nowhere.yaml recipes/qwen_pretrain.py",
    "torchrun --nproc-per-node 3 recipes/qwen_pretrain.py --tp 2",
    "accelerate launch --config_file recipes/configs/node_tp8.yaml recipes/qwen_finetune.py --model Qwen/Qwen2.5-7B-Instruct",
    "python examples/train_3d.py --steps 2",
    "python -m taco_accel.bench.throughput --rows x --no-such-flag",
    "python3 -m pytest tests/test_docs.py::test_no_such_test",
    "bash scripts/install.sh --stack ancient",
]


@pytest.mark.parametrize("command", REFUSED_COMMANDS)
def test_the_checks_refuse_a_command_that_would_fail(command):
    with pytest.raises(Exception):  # noqa: B017 - whichever the check or the library raises
        check_command(shlex.split(command))

# -- a python snippet, compiled and resolved ---------------------------------------------------

def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"]; None for anything but names and attributes."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def imported_names(tree: ast.Module) -> dict[str, object]:
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
                top = alias.name.split(".")[0]
                names[alias.asname or top] = importlib.import_module(alias.asname and alias.name or top)
        elif isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    importlib.import_module(f"{node.module}.{alias.name}")  # a submodule, or the ImportError
                names[alias.asname or alias.name] = getattr(module, alias.name)
    return names


def _resolve(chain: list[str], names: dict[str, object], types: dict[str, type]):
    """The object ``chain`` names (attributes of modules and classes followed), or None where it
    leaves what can be known without running (an instance's attribute). Raises AttributeError
    for an attribute a module or class lacks."""
    if chain[0] in names:
        obj = names[chain[0]]
    elif chain[0] in types and len(chain) > 1:
        cls = types[chain[0]]
        if not hasattr(cls, chain[1]):
            raise AttributeError(f"{chain[0]} (a {cls.__name__}) has no {chain[1]}")
        return None
    else:
        return None
    for part in chain[1:]:
        if not (inspect.ismodule(obj) or inspect.isclass(obj)):
            return None
        obj = getattr(obj, part)
    return obj


def _ours(obj) -> bool:
    return (getattr(obj, "__module__", None) or "").startswith("taco_accel")


def check_snippet(text: str) -> None:
    tree = ast.parse(text)
    names = imported_names(tree)
    types = {}  # a name assigned a taco_accel class's instance: its attributes are checked on the class
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            chain = _chain(node.value.func)
            cls = _resolve(chain, names, {}) if chain else None
            if inspect.isclass(cls) and _ours(cls):
                types[node.targets[0].id] = cls
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (chain := _chain(node)):
            _resolve(chain, names, types)
        if isinstance(node, ast.Call) and (chain := _chain(node.func)):
            fn = _resolve(chain, names, types)
            if fn is not None and callable(fn) and _ours(fn):
                if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
                    continue
                inspect.signature(fn).bind_partial(*[None] * len(node.args), **{k.arg: None for k in node.keywords})


SNIPPETS = every_block("python")


@pytest.mark.parametrize("block", SNIPPETS, ids=[b.where for b in SNIPPETS])
def test_every_python_snippet_compiles_and_names_what_exists(block: Block):
    try:
        check_snippet(block.text)
    except Exception as error:
        raise AssertionError(f"{block.where}: {type(error).__name__}: {error}\n{block.text}") from None


REFUSED_SNIPPETS = [  # what the checks must refuse
    "from taco_accel import Acelerator",
    "import taco_accel\ntaco_accel.parallelize(model, tensor_parallel=2)",
    "from taco_accel import Accelerator\naccelerator = Accelerator()\naccelerator.compression_statistics()",
    "import taco_accel\ntaco_accel.Compresion('on')",
    "from taco_accel import Compression\nCompression('on', site={'lm_head/*': None})",
]


@pytest.mark.parametrize("snippet", REFUSED_SNIPPETS)
def test_the_checks_refuse_a_snippet_that_would_fail(snippet):
    with pytest.raises((ImportError, AttributeError, TypeError)):
        check_snippet(snippet)


RUN_SNIPPETS = [b for b in SNIPPETS if b.mark == "run"]


@pytest.mark.parametrize("block", RUN_SNIPPETS, ids=[b.where for b in RUN_SNIPPETS])
def test_marked_snippets_run(block: Block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(block.text, block.where, "exec"), {"__name__": "__doc_snippet__"})


def test_the_marked_examples_run_as_one_process(tmp_path):
    """Each bash block marked ``<!-- test: run ARGS -->`` (one ``python SCRIPT`` command, run as
    documented with ARGS appended), one after the other in one process (tests/launches.py)."""
    jobs = []
    for block in every_block("bash"):
        if block.mark and block.mark.startswith("run"):
            (command,) = commands(block)
            assert command.words[0] in PYTHONS and command.words[1].endswith(".py"), command.where
            jobs += ["--job", command.where, str(ROOT / command.words[1]), *command.words[2:], *block.mark.split()[1:]]
    assert jobs, "no page marks an example to run"
    from harness import run_command
    from launches import launch_env

    done = run_command([sys.executable, str(ROOT / "tests/launches.py"), *jobs], env=launch_env(), cwd=tmp_path,
                       timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


# -- the pages as a whole ---------------------------------------------------------------------

def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[`*]|\[|\]\([^)]*\)", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", pages())
def test_every_relative_link_resolves(page):
    text = re.sub(r"```.*?```", "", (ROOT / page).read_text(), flags=re.S)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (ROOT / page).parent / path if path else ROOT / page
        assert file.exists(), f"{page}: a link to {target}, which does not exist"
        if anchor:
            assert anchor in anchors(file), f"{page}: a link to {target}, whose heading does not exist"


QUOTED_PATH = re.compile(r"^(recipes|examples|tests|scripts|docs|benchmarks|taco_accel|codec|comm|tp|models|parallel|"
                         r"integrations|training|upstream|data|bench)(/[\w.-]+)*/?$")


@pytest.mark.parametrize("page", pages())
def test_every_quoted_path_exists(page):
    """A path a page quotes (`tests/test_layering.py`, `codec/dispatch.py`, `recipes/configs/`)
    exists in the repository or in the package."""
    text = re.sub(r"```.*?```", "", (ROOT / page).read_text(), flags=re.S)
    for span in re.findall(r"`([^`\n]+)`", text):
        path = span.split("::")[0]
        if QUOTED_PATH.match(path) and re.search(r"(/|\.(py|md|yaml|txt|sh|json|jsonl))$", path):
            assert (ROOT / path).exists() or (ROOT / "taco_accel" / path).exists(), f"{page}: `{span}` does not exist"


NAMED_TEST = re.compile(r"`(tests/test_\w+\.py)::(test_\w+)(?:\[(\w+)\])?`")


def test_the_settings_table_names_tests_that_exist():
    """docs/settings.md: every row says honoured or refused, and names a test of the suite that
    exists (a parametrized one with one of its own parameters)."""
    import importlib

    rows = [line for line in (ROOT / "docs/settings.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith(("| setting", "| ---"))]
    assert len(rows) > 30, rows
    for row in rows:
        verdict = row.split(" | ")[1]
        assert verdict.startswith(("honoured", "refused")), row
        named = NAMED_TEST.findall(row)
        assert named, f"no test named: {row}"
        for path, name, parameter in named:
            test = getattr(importlib.import_module(Path(path).stem), name, None)
            assert test is not None, f"{path}::{name} does not exist"
            marks = [m for m in getattr(test, "pytestmark", []) if m.name == "parametrize"]
            if parameter:
                values = [v for m in marks for v in m.args[1]]
                assert parameter in values, f"{path}::{name}[{parameter}]: its parameters are {values}"


def test_the_module_map_has_every_module():
    """ARCHITECTURE.md names every module of the package: by its path (`comm/call.py`), or in the
    item of its folder (`data/`: ... `loader.py` ...; `bench/`: ... `codec` ...)."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    items = re.split(r"\n(?=- |\S)", text)  # list items with their continuation lines
    missing = []
    for path in sorted((ROOT / "taco_accel").rglob("*.py")):
        module = path.relative_to(ROOT / "taco_accel")
        if module.name == "__init__.py" or len(module.parts) == 1 and module.name != "errors.py":
            continue
        folder, stem = f"{module.parent.as_posix()}/", module.stem
        if f"`{module.as_posix()}`" in text:
            continue
        if not any(f"`{folder}`" in item and (f"`{stem}.py`" in item or f"`{stem}`" in item) for item in items):
            missing.append(module.as_posix())
    assert not missing, f"ARCHITECTURE.md's module map lacks {missing}: give each a line"


def test_every_results_row_is_reproduced_on_the_performance_page():
    """Each command in benchmarks/RESULTS.md's reproduce column is one of docs/performance.md's."""
    from doc_commands import INLINE, PROGRAMS

    page = {_normal(c.words) for b in blocks("docs/performance.md") if b.lang == "bash" for c in commands(b)}
    missing = []
    for line in (ROOT / "benchmarks/RESULTS.md").read_text().splitlines():
        if not line.startswith("| ") or line.startswith("| what"):
            continue
        for span in INLINE.findall(line.split(" | ")[-1]):
            words = shlex.split(span)
            command = [w for w in words if not re.fullmatch(r"[A-Z_]+=.*", w)]
            if command and (command[0] in PROGRAMS or command[0].startswith(("scripts/", ".ci/"))) \
                    and _normal(words) not in page:
                missing.append(span)
    assert not missing, f"docs/performance.md does not show how to reproduce {missing}"


def _normal(words) -> tuple[str, ...]:
    """A command as written in either place: ``pytest X`` = ``python3 -m pytest -q X``,
    ``scripts/x.sh`` = ``bash scripts/x.sh``, ``python3`` = ``python``."""
    w = [x for x in words if x != "-q"]
    env = [x for x in w if re.fullmatch(r"[A-Z_]+=.*", x)]
    w = [x for x in w if x not in env]
    if w[:3] in (["python", "-m", "pytest"], ["python3", "-m", "pytest"]):
        w = w[2:]
    if w[:1] == ["bash"]:
        w = w[1:]
    return tuple(env + ["python" if x == "python3" else x for x in w])


def test_the_readme_is_a_short_tour():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    assert "tests/" not in text and "test_" not in text  # test names live in docs/ and ARCHITECTURE.md


@pytest.mark.parametrize("page", [p for p in pages() if p.startswith("docs/")])
def test_every_docs_page_starts_with_an_example(page):
    lines = (ROOT / page).read_text().splitlines()
    first_section = next((i for i, line in enumerate(lines) if line.startswith("## ")), len(lines))
    assert any(line.startswith("```") for line in lines[:first_section]), \
        f"{page}: no example before its first section"


def raised_classes() -> set[str]:
    """The names of the exception classes the package raises: taco_accel.errors' and the builtins
    a ``raise`` statement of taco_accel names."""
    from taco_accel import errors

    names = {n for n, obj in vars(errors).items() if inspect.isclass(obj) and issubclass(obj, Exception)}
    for path in (ROOT / "taco_accel").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, (ast.Call, ast.Name)):
                func = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                name = func.id if isinstance(func, ast.Name) else None
                if name and isinstance(getattr(builtins, name, None), type) \
                        and issubclass(getattr(builtins, name), BaseException):
                    names.add(name)
    return names - {"SystemExit", "NotImplementedError", "AssertionError"}


def test_troubleshooting_names_every_error_the_package_raises():
    text = (ROOT / "docs/troubleshooting.md").read_text()
    headings = set(re.findall(r"^#+ `?(\w+)`?", text, re.M))
    missing = sorted(raised_classes() - headings)
    assert not missing, f"docs/troubleshooting.md has no section for {missing}"


# -- the generated tables -------------------------------------------------------------------

DOORS = {  # the entry matrix's entries as a user knows them
    "loop": "your own Accelerate loop", "trainer": "`taco_trainer(Trainer)`", "sft": "`taco_trainer(SFTTrainer)`",
    "dpo": "`taco_trainer(DPOTrainer)`, reference passed",
    "dpo_path": "`taco_trainer(DPOTrainer)`, reference from the path",
    "dpo_lora": "`taco_trainer(DPOTrainer)`, LoRA policy", "grpo": "`taco_trainer(GRPOTrainer)`",
    "finetuner": "the fine-tuning recipes (`Finetuner`)",
    "recipes": "the pretraining recipes (`Trainer`)",
}
PRECISIONS = {"fp32": "fp32", "bf16": "bf16 autocast", "bf16_params": "bf16 parameters", "fp16": "fp16 autocast"}
LAYOUTS = {"tp2": "tp=2", "dp2_tp2": "dp=2 x tp=2"}
# doors outside the matrix: checked elsewhere in one cell only, or refused when the class is made
NOT_CHECKED = ("`taco_trainer(KTOTrainer)`, `taco_trainer(RLOOTrainer)` beyond fp32 at tp=2 (tests/test_hf_trainer.py checks that)",)
REFUSED_DOORS = ("`taco_trainer` of TRL's other trainers (ORPO, online DPO, CPO, GKD, Reward, Distillation, ...)",)


def stack_versions(stack: str) -> str:
    pins = dict(line.split("==") for line in (ROOT / f"scripts/stacks/{stack}.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    return ", ".join(f"{name} {pins[name]}" for name in ("torch", "transformers", "accelerate", "peft", "trl"))


def support_table() -> str:
    """docs/support.md's table: every cell of tests/test_entry_matrix.py (supported: trained against
    one process there or by the test it names; refused: its one-line error asserted), on both
    stacks, which CI runs the whole suite on; the doors outside it, not checked."""
    import test_entry_matrix as matrix

    stacks = ("oldest", "newest")
    columns = [(layout, stack) for layout in matrix.LAYOUTS for stack in stacks]
    lines = ["| door | precision | " + " | ".join(f"{LAYOUTS[l]}, {s}" for l, s in columns) + " |",
             "| --- | --- |" + " --- |" * len(columns)]
    cells = set(matrix.CELLS)
    for entry in matrix.ENTRIES:
        for precision in matrix.PRECISIONS:
            row = []
            for layout, _ in columns:
                if (entry, precision, layout) not in cells:
                    row.append("not checked")
                elif (entry, precision) in matrix.REFUSED:
                    row.append("refused")
                else:
                    row.append("supported")
            door, shown = DOORS.get(entry, entry), PRECISIONS.get(precision, precision)
            lines.append(f"| {door} | {shown} | " + " | ".join(row) + " |")
    for door in NOT_CHECKED:
        lines.append(f"| {door} | any | " + " | ".join(["not checked"] * len(columns)) + " |")
    for door in REFUSED_DOORS:  # tests/test_upstream.py: taco_trainer raises naming the trainers it takes
        lines.append(f"| {door} | any | " + " | ".join(["refused"] * len(columns)) + " |")
    versions = [f"- {stack}: {stack_versions(stack)} ([scripts/stacks/{stack}.txt](../scripts/stacks/{stack}.txt))"
                for stack in stacks]
    return "\n".join([*versions, "", *lines])


TP_DEGREES = range(1, 65)


def presets_table() -> str:
    """docs/recipes.md's table: each pretraining preset's shapes and the tp degrees (up to 64) its
    model splits over (`check_tp`: heads, kv heads, MLP and every other split)."""
    from taco_accel.models.plan import plan_for
    from taco_accel.models.rewrite import check_tp
    from taco_accel.training.presets import FAMILY_PRESETS, model_config

    lines = ["| script | `--preset` | hidden size | layers | heads (kv heads) | tp |", "| --- | --- | ---: | ---: | --- | --- |"]
    for family, script in (("qwen2", "qwen_pretrain.py"), ("gpt2", "gpt_pretrain.py")):
        for preset in FAMILY_PRESETS[family]:
            config = model_config(family, preset, vocab_size=384, max_positions=128)
            heads = config.num_attention_heads
            kv = getattr(config, "num_key_value_heads", None) or heads
            model, fits = one_layer(config), []
            for tp in TP_DEGREES:
                try:
                    check_tp(model, plan_for(model), tp)
                    fits.append(str(tp))
                except ValueError:
                    pass
            lines.append(f"| {script} | {preset} | {config.hidden_size} | {config.num_hidden_layers} | "
                         f"{heads} ({kv}) | {', '.join(fits)} |")
    return "\n".join(lines)


TABLES = {"support": ("docs/support.md", support_table), "presets": ("docs/recipes.md", presets_table)}


def _marks(name: str) -> tuple[str, str]:
    return f"<!-- generated table {name}: python tests/test_docs.py --write -->", f"<!-- end of table {name} -->"


def _table_in_page(name: str) -> tuple[str, str, str]:
    start, end = _marks(name)
    head, rest = (ROOT / TABLES[name][0]).read_text().split(start)
    table, tail = rest.split(end)
    return head, table.strip("\n"), tail


@pytest.mark.parametrize("name", TABLES)
def test_the_generated_tables_are_current(name):
    """docs/support.md's table is the entry matrix's cells; docs/recipes.md's the presets' tp degrees."""
    page, make = TABLES[name]
    assert _table_in_page(name)[1] == make(), f"{page}'s table is stale: python tests/test_docs.py --write"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Rewrite the generated tables of docs/ (support, presets).")
    parser.add_argument("--write", action="store_true", required=True, help="rewrite the tables in their pages")
    parser.parse_args()
    sys.path.insert(0, str(ROOT))
    for name, (page, make) in TABLES.items():
        head, _, tail = _table_in_page(name)
        start, end = _marks(name)
        (ROOT / page).write_text(f"{head}{start}\n{make()}\n{end}{tail}")
        print(f"wrote the {name} table of {page}")
