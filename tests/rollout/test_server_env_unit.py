"""A launched server's temporary folder is its own (``TMPDIR``: tests/test_leftovers.py), while torch's compile cache
stays where torch would have put it: ``process.inductor_cache_dir`` is torch's default, written out."""

from __future__ import annotations

import getpass

import pytest
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from lightning_grpo.rollout.server.process import inductor_cache_dir


def test_the_compile_cache_is_torchs_default():
    assert inductor_cache_dir() == default_cache_dir()


@pytest.mark.parametrize("error", [KeyError, OSError])
def test_a_uid_without_a_user_name_falls_back_as_torch_does(monkeypatch, error):
    """A container's uid with no passwd entry: getuser raises, and the launch must not."""

    def no_name():
        raise error("no passwd entry")

    monkeypatch.setattr(getpass, "getuser", no_name)
    assert inductor_cache_dir() == default_cache_dir()
    assert "torchinductor_uid_" in inductor_cache_dir()
