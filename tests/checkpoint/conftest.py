import pytest

from tests.checkpoint.tiny_hf import one_thread


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield
