"""Issue 52: the planner models packed rows as the collator lays them out (a plan at the mean sample under-counts the
padding of a micro-batch's rows)."""

import pytest
import torch

from neva.config import compose_config
from neva.data.collate import collate_packed
from neva.planner.plan import packed_rows, plan_run


def sample(n: int) -> dict:
    ids = torch.arange(n) % 7 + 1
    return {"input_ids": ids, "labels": ids, "pixel_values": torch.zeros(0, 3, 2, 2), "id": "s"}


@pytest.mark.parametrize(("seq", "micro", "row", "multiple"),
                         [(576, 16, 8192, 64), (600, 3, 1000, 64), (4000, 4, 4096, 64), (4000, 2, 4096, 1),
                          (100, 1, 8192, 64), (128, 64, 1024, 64)])  # fmt: skip
def test_packed_rows_are_the_collators(seq, micro, row, multiple):
    batch = collate_packed([sample(seq) for _ in range(micro)], pad_id=0, seq_length=row, pad_to_multiple_of=multiple)
    assert packed_rows(seq, micro, row, multiple) == tuple(batch.input_ids.shape)


def test_a_packed_plan_counts_its_rows():
    unpacked = compose_config(["+preset=qwen_vl_finetune_qwen2_5_vl_7b", "model.data.packing=false"])
    packed = compose_config(["+preset=qwen_vl_finetune_qwen2_5_vl_7b"])
    assert packed.model.data.packing
    mean, with_rows = plan_run(unpacked), plan_run(packed)
    facts = with_rows.extra["packing"]
    assert facts["mean_sample"] == mean.seq_len and facts["row_limit"] == packed.model.data.seq_length
    micro = with_rows.deployment.layout.micro_batch_size
    assert (facts["rows"], facts["row_tokens"]) == packed_rows(mean.seq_len, micro, facts["row_limit"], 64)
    assert with_rows.seq_len * micro >= facts["rows"] * facts["row_tokens"] > mean.seq_len * micro - 64
    assert with_rows.peak.activations >= mean.peak.activations
