import os

import pytest

# Tests never reach a model hub; fail fast instead of hanging on a network call.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A random tiny neva checkpoint with the synthetic tokenizer (``conv_template`` vicuna_v1), for the commands
    that read one."""
    import torch

    from neva.checkpoint.neva_format import save_checkpoint
    from neva.data.synthetic import build_tokenizer
    from neva.models.neva import NevaModel
    from neva.models.presets import build_config

    path = tmp_path_factory.mktemp("tiny") / "ckpt"
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = NevaModel(
        build_config(vocab_size=len(tokenizer), image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    )
    model.init_weights()
    save_checkpoint(path, model.cfg, model.state_dict(), tokenizer, metadata={"conv_template": "vicuna_v1"})
    return path
