import os

import pytest

# Tests never reach a model hub; fail fast instead of hanging on a network call.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A random tiny neva checkpoint of the default preset with the synthetic tokenizer (``conv_template``
    vicuna_v1), for the commands that read one."""
    from tests.fixtures.checkpoints import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", metadata={"conv_template": "vicuna_v1"})
