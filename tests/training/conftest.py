import pytest

from neva.checkpoint.source import resolve_source
from neva.config import compose_config
from neva.data.datamodule import NevaDataModule

# A lean version of the embedded default: 2-layer LLM, few samples, no loggers or progress bar.
LEAN = [
    "+model.mm_cfg.llm.arch_overrides.num_layers=2",
    "model.data.synthetic_train_samples=120",  # 7 micro-batches of 16: a leftover at each epoch end
    "model.data.synthetic_val_samples=16",
    "exp_manager.create_tensorboard_logger=false",
    "trainer.enable_progress_bar=false",
    "trainer.val_check_interval=1000",
]


@pytest.fixture
def lean_cfg(tmp_path):
    def make(*overrides: str, stage: str = "pretrain"):
        return compose_config([f"+stage={stage}", *LEAN, f"exp_manager.exp_dir={tmp_path}/{stage}", *overrides])

    return make


def micro_batches(cfg, n: int, micro: int):
    """``n`` micro-batches of ``micro`` samples from the config's data, in training order."""
    source = resolve_source(cfg)
    dm = NevaDataModule(cfg.model.data, source.tokenizer, source.cfg, micro_batch_size=micro, seed=cfg.model.seed)
    out = []
    for batch in dm.train_dataloader():
        out.append(batch)
        if len(out) == n:
            return source, out
    raise AssertionError("not enough data")
