"""One torch thread for a test module: a tiny model gains nothing from two,
and they fight the rest of a loaded machine.  Import the fixture into a
module (``from torch_threads import one_torch_thread  # noqa: F401``)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
