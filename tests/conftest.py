import os
import shutil
import signal
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
# One intra-op thread per pytest-xdist worker and core (also in every process a test starts: they
# inherit it). At torch's default of a thread per core, two workers and the processes their tests start
# ran 4-6 threads on 2 cores, and OpenMP spent a third of the CPU time waiting for its threads
# (test_flat_engine, test_engine, test_elastic on two workers: 251 -> 163 s user time, 260 -> 213 s).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # in a worker; a serial run keeps torch's default
    _workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _workers)))
# The tests of a terminal's Ctrl-C (test_signals.py) need SIGINT delivered as from a terminal. A command started
# with SIGINT ignored (a shell's background job: `make test &`; session 60's `(CI=true .ci/run &)` had 2
# failures, then 14 errors from test_signals.py's check) passes that on to every process, pytest-xdist's workers
# and the processes the tests start: Python's own handler back in each (a started process then gets SIGINT's
# default again at exec, as from a terminal).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# `make test` gives each pytest-xdist worker a test file at a time, in collection order (the Makefile turns
# xdist's own order, by test count, off): the longest files go first, so the last to start are short ones and
# both workers end together (longest-processing-time-first). The files of 60 s or more of worker time,
# longest first, as session 49 measured them (2 workers, `pytest -v --durations=0`, a test's seconds summed
# per file; test_signals.py was part of test_faults.py then); the others follow in collection order. Its
# suite ended with one worker idle for 2 minutes (test_slurm.py, 189 s, was the last file to start); in that
# run's times this order ends both within 3 s. A file missing here or a stale entry only costs time.
LONGEST_FIRST = ("test_gpu_script.py", "test_triton_attention.py", "test_cli.py", "test_train.py", "test_slurm.py",
                 "test_faults.py", "test_signals.py", "test_bias_activation.py", "test_launch.py", "test_bad_input.py",
                 "test_flat_engine.py", "test_stream.py", "test_flat_reduce16.py", "test_elastic.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


@pytest.fixture(scope="session")
def world():
    """A world of one process (gloo, TP=1) shared by the single-process model tests."""
    from megamlm.config import ParallelConfig
    from megamlm.parallel import init_distributed

    return init_distributed(ParallelConfig(tensor_parallel=1))


@pytest.fixture(scope="module", autouse=True)
def _remove_the_modules_temp_dirs(request, tmp_path_factory):
    """Remove what a module's fixtures made under the temp root once its last test ends, unless one failed.

    pytest removes a passing test's tmp_path itself (pyproject: tmp_path_retention_policy); the module-scoped
    fixtures' folders (shards, the uninterrupted runs the resume tests compare with: up to 0.6 GB each)
    would otherwise stay until the session ends. Autouse and module-scoped, this fixture is set up before
    the module's other fixtures and torn down after them. A failed module keeps its folders to look at.
    """
    root = tmp_path_factory.getbasetemp()
    before = set(root.iterdir())
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed == failed_before:
        for path in set(root.iterdir()) - before:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
