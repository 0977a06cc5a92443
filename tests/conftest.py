import ctypes
import gc
import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    # the suite runs on two worker processes (pyproject's -n 2), one per core: with torch's default of a thread per
    # core each, four OpenMP threads spin against each other and the suite runs several times slower. One thread per
    # worker, and for the processes the tests start (set before numpy or torch is imported here)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:   # the core install: the tests that need torch skip
        pass

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=40, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(session, config, items):
    """``PYTEST_REVERSE=1`` runs the collected tests in reverse order (an order-independence check; random order:
    ``-p randomly``)."""
    if os.environ.get("PYTEST_REVERSE") == "1":
        items.reverse()


@pytest.fixture(autouse=True, scope="module")
def _return_freed_memory():
    """After each test module, collect garbage and hand freed heap pages back to the OS (glibc's
    ``malloc_trim``): the accountants' large temporary grids otherwise keep the process's resident memory
    high for the rest of the run, and the suite has a 3 GB budget."""
    yield
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):   # not glibc
        pass
