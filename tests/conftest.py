"""Suite-wide settings."""

import atexit
import os
import shutil
import tempfile

import pytest

# The order search caches its results on disk by default (~/.cache/pp_offload/orders): tests search
# afresh and leave nothing behind. Set before any test imports the search; child processes inherit it.
os.environ["PP_OFFLOAD_ORDER_CACHE"] = "off"
# Runs prepare their data into a cache shared by every run, under $HF_DATASETS_CACHE by default
# (docs/data.md): the suite's runs share one of their own, removed at the end, and the user's stays untouched.
_DATASETS_CACHE = tempfile.mkdtemp(prefix="pp_offload-tests-datasets-")
os.environ["HF_DATASETS_CACHE"] = _DATASETS_CACHE
atexit.register(shutil.rmtree, _DATASETS_CACHE, ignore_errors=True)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (tiny shapes: more threads only add synchronization and noise on a
    busy machine); modules use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def quiet_datasets():
    """No `datasets` progress bars in the module's tests (restored after): test output stays readable."""
    import datasets

    was_disabled = datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    yield
    if not was_disabled:
        datasets.enable_progress_bars()
