import os
import sys

# Worker functions of multi-rank tests are pickled by module name: keep tests/ importable.
sys.path.insert(0, os.path.dirname(__file__))

# One thread per process, set before torch (and NumPy's BLAS, which the Triton interpreter uses) is
# imported: the suite's tensors are tiny, where OpenMP threads cost more CPU than they save, and the
# cores are shared by the ranks and launches the tests start (which inherit it) and by
# pytest-xdist's processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Without a GPU the Triton kernels run under the interpreter; triton reads this flag when a
# kernel is defined, so it must be set before taco_accel's kernels are imported.
try:
    import torch

    _has_cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Where the tests run: on the CPU over gloo, on any machine, unless a test puts its tensors on a GPU
# itself (tests/test_tp_cuda.py, test_triton_kernels.py, the CUDA-graph test of test_compile.py).
# Accelerate's state (hence taco_accel.Accelerator's device and its mesh's backend, and the recipes'
# trainers built on it) and transformers' TrainingArguments read this variable; every rank, launch and
# one-process reference started from this session inherits it. On a GPU box an Accelerator would
# otherwise take the GPU: two ranks on one GPU fail in NCCL ("Duplicate GPU detected"), and a model
# moved to the GPU meets the CPU tensors the tests feed it, in one process as on several.
os.environ["ACCELERATE_USE_CPU"] = "1"

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def token_cache(tmp_path_factory) -> str:
    """One tokenizer and token cache for the whole session (``TrainConfig.cache_dir``): the
    training tests share the shipped corpus's tokens, built once (several seconds) instead of
    once per module; entries are keyed by a hash of the tokenizer and the text."""
    return str(tmp_path_factory.mktemp("token_cache"))


@pytest.fixture(autouse=True)
def _no_process_group_leaks_between_tests():
    """A test that builds a one-process world in this process (an in-process `taco_accel.Accelerator`
    initialises a gloo group of size 1) must not hand it to the tests after it: one that expects
    "no torch.distributed" would see a world of 1 instead, and the suite would depend on its order."""
    import torch.distributed as dist

    started_without = not (dist.is_available() and dist.is_initialized())
    yield
    if started_without and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def shared_launches(tmp_path_factory):
    """``mesh -> {job: results}``: the launches several modules share (tests/launches.py), once per
    session; under pytest-xdist in the session's folder that every worker process sees."""
    import launches

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    return lambda mesh: launches.shared_launch(root, mesh)
