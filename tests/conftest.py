import os
import sys

import pytest

# make `import megamlm` work from a source checkout without installation, also in spawned ranks
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("PYTHONPATH", ROOT)
# Triton kernels (model.attention_backend=triton) run in Triton's interpreter on CPU tensors; read when
# the kernels are defined, so before anything imports megamlm
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def world():
    """A world of one process (gloo, TP=1) shared by the single-process model tests."""
    from megamlm.config import ParallelConfig
    from megamlm.parallel import init_distributed

    return init_distributed(ParallelConfig(tensor_parallel=1))
