"""Launches that several test modules share: one ``accelerate launch`` per mesh runs every worker
that trains on that mesh, one after the other in the same processes (a launch's start-up, the
imports of torch, transformers, Accelerate and TRL in every process, is most of its cost).

In the test process: each module registers its worker's job on a mesh at import (`register`),
and its fixture reads the job's results from `shared_launch` (conftest's ``shared_launches``),
which launches every job registered on the mesh the first time one is asked for. Under
pytest-xdist the first worker process to ask launches; the others wait for it (a file lock in
the session's shared temporary folder) and read the same results.

In the launch (``accelerate launch --config_file M.yaml tests/launches.py --job NAME MODULE ARG ...
--job ...``): each job is ``MODULE.main()`` with ``ARG ...`` as its command line, in a fresh
Accelerate state (a job's mixed precision is fixed once per state; the process group stays); a
MODULE ending in ``.py`` is a script's path, run as ``python SCRIPT ARG ...`` would run it (the
documented examples, tests/test_docs.py). A job that raises is reported on stderr and the next one
runs; its test then finds no results.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import runpy
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from harness import run_command

ROOT = Path(__file__).resolve().parents[1]
MESHES = {  # processes, the launch config's parallelism sizes
    "tp2": (2, {"parallelism_config_tp_size": 2}),
    "dp2_tp2": (4, {"parallelism_config_tp_size": 2, "parallelism_config_dp_replicate_size": 2}),
}
# name: (mesh, worker module, its arguments given the job's folder); --out <folder>/result.json comes first
JOBS: dict[str, tuple[str, str, Callable[[Path], list[str]]]] = {}


def launch_config(path: Path, processes: int, sizes: dict) -> Path:
    """An accelerate config as `accelerate config` writes it: CPU processes started by torchrun."""
    lines = ["compute_environment: LOCAL_MACHINE", "distributed_type: MULTI_GPU", "use_cpu: true",
             "num_machines: 1", f"num_processes: {processes}", "machine_rank: 0", "mixed_precision: 'no'",
             "rdzv_backend: static", "same_network: true", f"main_process_port: {free_port()}",
             "parallelism_config:"] + [f"  {k}: {v}" for k, v in sizes.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(**extra: str) -> dict:
    """This environment without a parent launch's rank variables, one thread per process, this
    checkout first on the path (then the caller's PYTHONPATH), no GPU visible; plus ``extra``.
    No GPU: every launched script is a CPU test, and a one-process run of transformers' Trainer
    takes ``cuda:0`` whenever CUDA is available, ``ACCELERATE_USE_CPU`` or not (its
    ``TrainingArguments`` choose a one-process run's device from ``use_cpu`` alone, 5.10 to 5.25),
    so that a reference on a GPU box would train in other arithmetic than the ranks it is compared
    with."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=path, CUDA_VISIBLE_DEVICES="", **extra)
    return env


# what the Trainer workers' processes add to `launch_env`: collectives fail after 2 minutes, no hub
TRAINER_ENV = dict(TACO_TIMEOUT_S="120", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def trainer_env() -> dict:
    return launch_env(**TRAINER_ENV)


def accelerate_launch(config: Path, script: Path, *args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), str(script), *args]
    return run_command(cmd, env=launch_env(**(env or {})), cwd=cwd)


def register(name: str, mesh: str, worker: str, args: Callable[[Path], list[str]]) -> None:
    """Job ``name``: ``worker.main()`` (a module of tests/) in the shared launch of ``mesh``, with
    ``--out FOLDER/result.json`` and ``args(FOLDER)`` as its command line."""
    if mesh not in MESHES:
        raise ValueError(f"mesh {mesh!r}: use one of {sorted(MESHES)}")
    JOBS[name] = (mesh, worker, args)


def shared_launch(root: Path, mesh: str) -> dict:
    """``{job: its result.json and "dir": its folder, or {"launch_error": the launch's output}}`` of
    every job registered on ``mesh``, launched once under ``root`` (a folder every pytest process of
    the session shares)."""
    folder = root / f"launch_{mesh}"
    folder.mkdir(parents=True, exist_ok=True)
    with open(root / f"launch_{mesh}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another xdist worker may be launching it: wait for it
        log = folder / "log.txt"
        if not log.exists():
            _launch(folder, mesh)
        results = {}
        for name in (n for n, (m, _, _) in JOBS.items() if m == mesh):
            out = folder / name / "result.json"
            results[name] = {**json.loads(out.read_text()), "dir": str(folder / name)} if out.exists() \
                else {"launch_error": log.read_text()[-9000:]}
        return results


def _launch(folder: Path, mesh: str) -> None:
    processes, sizes = MESHES[mesh]
    argv = []
    for name, (m, worker, args) in JOBS.items():
        if m == mesh:
            (folder / name).mkdir(exist_ok=True)
            argv += ["--job", name, worker, "--out", str(folder / name / "result.json"), *args(folder / name)]
    done = accelerate_launch(launch_config(folder / "config.yaml", processes, sizes), Path(__file__), *argv,
                             cwd=folder, env=TRAINER_ENV)
    (folder / "log.txt").write_text(f"exit status {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-12000:]}")


def _jobs(argv: list[str]) -> list[tuple[str, str, list[str]]]:
    """``--job NAME MODULE ARG ... --job ...`` as (name, module, arguments)."""
    jobs = []
    for word in argv:
        if word == "--job":
            jobs.append([])
        else:
            jobs[-1].append(word)
    return [(job[0], job[1], job[2:]) for job in jobs]


def main() -> None:
    import importlib

    from accelerate.state import AcceleratorState, GradientState

    sys.path.insert(0, str(Path(__file__).parent))
    failed = []
    for name, module, args in _jobs(sys.argv[1:]):
        AcceleratorState._reset_state()
        GradientState._reset_state()
        script = module.endswith(".py")
        sys.argv = [module if script else f"{module}.py", *args]
        try:
            if script:
                runpy.run_path(module, run_name="__main__")
            else:
                importlib.import_module(module).main()
        except Exception:  # noqa: BLE001 - the next job runs; this one's test finds no results
            failed.append(name)
            print(f"job {name} ({module}) failed on rank {os.environ.get('RANK')}:\n{traceback.format_exc()}",
                  file=sys.stderr)
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
