"""A training micro-batch runs without host-device syncs: the collator finds image positions, LM-head positions and
targets on the host, and the model only indexes with them (neva.data.collate, NevaModel.embed, LlamaDecoder)."""

import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from neva.models.loss import learned_positions
from neva.models.media import Media
from tests.training.conftest import micro_batches
from tests.training.test_semantics import make_engine

aten = torch.ops.aten
# Ops whose result (or output shape) depends on tensor values: on a GPU each waits for the device.
SYNCING = {
    aten._local_scalar_dense.default,  # .item(), int(), bool(), .tolist()
    aten.nonzero.default,
    aten.masked_select.default,
    aten.masked_scatter.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.unique_consecutive.default,
}


class OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_collated_positions_are_the_model_s_and_the_step_has_no_sync(lean_cfg):
    cfg = lean_cfg()
    source, batches = micro_batches(cfg, 1, 4)
    batch = batches[0]
    is_image = batch.input_ids == source.cfg.image_token_id
    assert batch.media.image.items_per_row.sum() > 0
    assert torch.equal(batch.media.image.positions, is_image.nonzero())
    positions, targets = learned_positions(batch.labels)
    assert torch.equal(batch.output_positions, positions) and torch.equal(batch.targets, targets)

    engine = make_engine(cfg, source)
    plain = batch.with_(
        output_positions=None, targets=None, media=Media(image=dataclasses.replace(batch.media.image, positions=None))
    )
    with torch.no_grad():  # the same loss as the path that finds positions itself (masked_scatter, boolean mask)
        torch.testing.assert_close(engine.loss_sum(batch), engine.loss_sum(plain), rtol=0, atol=0)
    n_tokens = engine.global_tokens([batch])
    with OpRecorder() as rec:
        engine.forward_backward([batch], n_tokens=n_tokens)
    assert len(rec.ops) > 100
    assert not SYNCING & set(rec.ops), SYNCING & set(rec.ops)
    with OpRecorder() as rec, torch.no_grad():  # the recorder does see the old path's syncs
        engine.loss_sum(plain)
    assert SYNCING & set(rec.ops)
