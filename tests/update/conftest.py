"""The update/ unit tier: shared fixtures. The toy model itself lives in ``tests/toy.py`` (tests/objectives uses it
too); every test here is marked ``unit`` by its folder (tests/conftest.py)."""

import pytest
from toy import make_toy


@pytest.fixture
def toy_lm():
    """``make_toy``: a factory, so a test builds the reference and the chunked run from the same seed."""
    return make_toy
