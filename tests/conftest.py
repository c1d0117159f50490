import os
import sys

# Worker functions of multi-rank tests are pickled by module name: keep tests/ importable.
sys.path.insert(0, os.path.dirname(__file__))

# Without a GPU the Triton kernels run under the interpreter; triton reads this flag when a
# kernel is defined, so it must be set before taco_accel's kernels are imported.
try:
    import torch

    _has_cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
