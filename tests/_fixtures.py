"""Fixtures shared by several test modules; import the ones a module needs."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread_and_clean_dynamo():
    """One intra-op thread (two ranks share two cores) and no compiled code left
    over from another test: every test starts and ends with an empty dynamo cache."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    yield
    torch.set_num_threads(threads)
    torch._dynamo.reset()
