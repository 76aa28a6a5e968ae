"""Suite-wide settings."""

import os

import pytest

# The order search caches its results on disk by default (~/.cache/pp_offload/orders): tests search
# afresh and leave nothing behind. Set before any test imports the search; child processes inherit it.
os.environ["PP_OFFLOAD_ORDER_CACHE"] = "off"


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
