import os

import pytest

# Tests never touch the network or the user's cache.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    os.environ["LIGHTNING_GRPO_CACHE"] = str(tmp_path_factory.mktemp("grpo-cache"))


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory):
    """A small Qwen2 policy folder (hidden 64, head_dim 32) with the char tokenizer."""
    from helpers import SMALL
    from lightning_grpo.policy import build_tiny_policy

    return build_tiny_policy(tmp_path_factory.mktemp("tiny-policy"), SMALL)
