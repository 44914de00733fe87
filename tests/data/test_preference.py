"""Preference pairs: both record formats, the rendering and exact masks of finetuning, the bad-pair rules, the
concatenated batch, the built-in synthetic pairs."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from neva.constants import IGNORE_INDEX
from neva.data import DataConfig
from neva.data.dataset import process_record
from neva.data.preference import PreferenceDataModule
from neva.errors import ConfigError
from neva.models.presets import build_config

QUESTION = "What color is the shape?"
LLAVA_NEXT = {"id": "a", "image": "red.png", "prompt": f"<image>\n{QUESTION}", "chosen": "red", "rejected": "blue"}
TRL = {
    "id": "b",
    "images": ["red.png"],
    "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
    "chosen": [{"role": "assistant", "content": "red"}],
    "rejected": [{"role": "assistant", "content": [{"type": "text", "text": "blue"}]}],
}
BAD = {
    "no_image": {**LLAVA_NEXT, "image": None},
    "empty_chosen": {**LLAVA_NEXT, "chosen": "  "},
    "empty_rejected": {**LLAVA_NEXT, "rejected": ""},
    "chosen_equals_rejected": {**LLAVA_NEXT, "rejected": "red"},
    "malformed_pair": {"id": "m", "image": "red.png", "prompt": "<image>\nhi", "chosen": "yes"},
    "image_count_mismatch": {**LLAVA_NEXT, "prompt": "<image>\n<image>\nTwo?"},
}
MULTI_TURN = {
    "id": "c",
    "images": ["red.png"],
    "prompt": [
        {"role": "user", "content": f"<image>\n{QUESTION}"},
        {"role": "assistant", "content": "red"},
        {"role": "user", "content": "And its shape?"},
    ],
    "chosen": "circle",
    "rejected": "square",
}


def module(tmp_path, tokenizer, records, **kw):
    Image.new("RGB", (32, 32), "red").save(tmp_path / "red.png")
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    fields = dict(data_path=str(path), image_folder=str(tmp_path), conv_template="vicuna_v1", seq_length=256,
                  pad_to_multiple_of=8)  # fmt: skip
    cfg = DataConfig(**{**fields, **kw.pop("data", {})})
    model = build_config(image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    dm = PreferenceDataModule(cfg, tokenizer, model, micro_batch_size=len(records), **kw)
    dm.setup()
    return dm


def learned_text(tokenizer, sample) -> str:
    return tokenizer.decode([t for t in sample["labels"].tolist() if t != IGNORE_INDEX]).strip()


def test_both_formats_render_as_a_finetuning_turn_and_learn_only_the_reply(tmp_path, synthetic_tokenizer):
    dm = module(tmp_path, synthetic_tokenizer, [LLAVA_NEXT, TRL])
    ds = dm.train_datasets[0]
    a, b = ds[0], ds[1]
    conversation = {"id": "a", "image": "red.png", "conversations": [
        {"from": "human", "value": f"<image>\n{QUESTION}"}, {"from": "gpt", "value": "red"}]}  # fmt: skip
    base = ds.base
    finetune = process_record(conversation, base.settings, base.image_source, base.front_end)
    for pair in (a, b):  # the same ids and labels as finetuning's sample of that conversation
        assert torch.equal(pair["chosen"]["input_ids"], finetune["input_ids"])
        assert torch.equal(pair["chosen"]["labels"], finetune["labels"])
    assert torch.equal(a["rejected"]["input_ids"], b["rejected"]["input_ids"])
    assert learned_text(synthetic_tokenizer, a["chosen"]).startswith("red")
    assert learned_text(synthetic_tokenizer, a["rejected"]).startswith("blue")
    assert "color" not in learned_text(synthetic_tokenizer, a["chosen"])


def test_a_multi_turn_prompt_learns_only_the_final_reply(tmp_path, synthetic_tokenizer):
    pair = module(tmp_path, synthetic_tokenizer, [MULTI_TURN]).train_datasets[0][0]
    for side, reply in (("chosen", "circle"), ("rejected", "square")):
        text = learned_text(synthetic_tokenizer, pair[side])
        assert text.replace(" ", "").startswith(reply) and "red" not in text


def test_bad_pairs_are_counted_skips_with_their_reason(tmp_path, synthetic_tokenizer):
    ds = module(tmp_path, synthetic_tokenizer, list(BAD.values())).train_datasets[0]
    assert [ds[i].get("skipped") for i in range(len(BAD))] == list(BAD)


def test_precomputed_reference_logps_ride_in_the_batch_in_row_order(tmp_path, synthetic_tokenizer):
    records = [{**LLAVA_NEXT, "ref_chosen_logps": -1.5, "ref_rejected_logps": -2.5},
               {**TRL, "ref_chosen_logps": -3.0, "ref_rejected_logps": -4.0}, LLAVA_NEXT]  # fmt: skip
    dm = module(tmp_path, synthetic_tokenizer, records, precomputed=True)
    assert dm.train_datasets[0][2]["skipped"] == "no_reference_logps"
    batch = dm.collator([dm.train_datasets[0][i] for i in range(3)])
    assert batch.stage.pairs == 2 and batch.input_ids.shape[0] == 4
    assert batch.stage.ref_logps.tolist() == [-1.5, -3.0, -2.5, -4.0]
    assert batch.counts.skipped == {"no_reference_logps": 1}
    # rows [0, P) the chosen replies, [P, 2P) the rejected ones of the same pairs
    assert learned_text(synthetic_tokenizer, {"labels": batch.labels[0]}).startswith("red")
    assert learned_text(synthetic_tokenizer, {"labels": batch.labels[2]}).startswith("blue")


def test_shards_are_refused_in_one_line(tmp_path, synthetic_tokenizer):
    for n in range(2):
        (tmp_path / f"pairs-{n:06d}.tar").write_bytes(b"")
    spec = str(tmp_path / "pairs-{000000..000001}.tar")
    with pytest.raises(ConfigError, match=r"model\.data\.data_path"):
        module(tmp_path, synthetic_tokenizer, [LLAVA_NEXT], data={"data_path": spec})


def test_builtin_synthetic_pairs_prefer_the_right_answer(synthetic_tokenizer):
    cfg = DataConfig(data_path="synthetic_preference", conv_template="vicuna_v1", synthetic_train_samples=12)
    model = build_config(image_token_id=synthetic_tokenizer.convert_tokens_to_ids("<image>"))
    dm = PreferenceDataModule(cfg, synthetic_tokenizer, model, micro_batch_size=4)
    dm.setup()
    records = dm.train_datasets[0].base.records
    assert len(records) == 12 and all(r["chosen"] != r["rejected"] for r in records)
    batch = next(iter(dm.train_dataloader()))
    assert batch.stage.pairs == 4 and not batch.counts.skipped


def test_a_pair_encodes_its_images_once(tmp_path, synthetic_tokenizer):
    """The rejected rows read the chosen rows' features: the tower sees each pair's images once, and the model's
    embeddings equal those of a batch where both sides carry their own images."""
    from neva.data.collate import collate_padded
    from neva.models.neva import NevaModel

    two = {**LLAVA_NEXT, "id": "two", "image": ["red.png", "red.png"], "prompt": f"<image>\n<image>\n{QUESTION}"}
    dm = module(tmp_path, synthetic_tokenizer, [LLAVA_NEXT, two, TRL])
    pairs = [dm.train_datasets[0][i] for i in range(3)]
    batch = dm.collator(pairs)
    image = batch.media.image
    assert image.pixels.shape[0] == 4 and image.items_per_row.tolist() == [1, 2, 1, 1, 2, 1]
    once = image.positions.shape[0] // 2
    assert image.feature_rows.tolist() == list(range(once)) * 2
    both = collate_padded([p["chosen"] for p in pairs] + [p["rejected"] for p in pairs], dm.collator.pad_id, 8, 256)
    assert both.media.image.pixels.shape[0] == 8 and torch.equal(both.input_ids, batch.input_ids)
    torch.manual_seed(0)
    model = NevaModel(build_config(image_token_id=synthetic_tokenizer.convert_tokens_to_ids("<image>")))
    model.init_weights()
    with torch.no_grad():
        got = model.embed(batch.input_ids, batch.media)
        want = model.embed(both.input_ids, both.media)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_video_pair_renders_as_finetuning_and_encodes_its_frames_once(tmp_path, synthetic_tokenizer):
    """LLaVA-NeXT's DPO records may name a ``video`` (LLaVA-Hound's video DPO): the pair renders as finetuning's video
    sample and the tower sees each pair's frames once."""
    import dataclasses

    from neva.models.video import VideoConfig

    from .video_files import write_video

    write_video(tmp_path / "clip.mp4", 8)
    record = {"id": "v", "video": "clip.mp4", "prompt": "<video>\nWhich way?", "chosen": "left", "rejected": "up"}
    (tmp_path / "pairs.jsonl").write_text(json.dumps(record))
    image_id = synthetic_tokenizer.convert_tokens_to_ids("<image>")
    model = dataclasses.replace(build_config(image_token_id=image_id), video=VideoConfig(), video_token_id=image_id)
    data = DataConfig(data_path=str(tmp_path / "pairs.jsonl"), video_folder=str(tmp_path), num_frames=4,
                      conv_template="vicuna_v1", seq_length=512, pad_to_multiple_of=8)  # fmt: skip
    dm = PreferenceDataModule(data, synthetic_tokenizer, model, micro_batch_size=1)
    dm.setup()
    ds = dm.train_datasets[0]
    pair = ds[0]
    conversation = {"id": "v", "video": ["clip.mp4"], "conversations": [
        {"from": "human", "value": "<video>\nWhich way?"}, {"from": "gpt", "value": "left"}]}  # fmt: skip
    b = ds.base
    finetune = process_record(conversation, b.settings, b.image_source, b.front_end, b.video_source)
    assert torch.equal(pair["chosen"]["input_ids"], finetune["input_ids"])
    assert torch.equal(pair["chosen"]["labels"], finetune["labels"])
    video = dm.collator([pair]).media.video
    assert video.frames.tolist() == [4] and video.pixels.shape[0] == 4  # one pair, one video of 4 frames
    assert video.positions.shape[0] == 2 * model.video_tokens(4) and video.feature_rows is not None


def test_preview_shows_both_sides_as_training_encodes_them(tmp_path, synthetic_tokenizer):
    """``neva.data.preview --json`` on preference records: ``<id> chosen`` and ``<id> rejected`` with the ids and labels
    the DPO stage trains on (final reply only), a bad pair as its skip reason; the text view highlights one reply."""
    import io

    from neva.data.preview import build_parser, preview

    records = [LLAVA_NEXT, MULTI_TURN, BAD["chosen_equals_rejected"]]
    ds = module(tmp_path, synthetic_tokenizer, records).train_datasets[0]
    common = ["--data-path", str(tmp_path / "pairs.jsonl"), "--conv-template", "vicuna_v1", "--tokenizer", "synthetic",
              "--num-image-tokens", str(ds.base.settings.num_image_tokens)]  # fmt: skip
    out = io.StringIO()
    assert preview(build_parser().parse_args([*common, "--json"]), out) == 1
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["id"] for r in rows] == ["a chosen", "a rejected", "c chosen", "c rejected", "a"]
    assert rows[-1]["skipped"] == "chosen_equals_rejected"
    for i in range(2):
        pair = ds[i]
        for side, row in zip(("chosen", "rejected"), rows[2 * i : 2 * i + 2]):
            assert (
                row["input_ids"] == pair[side]["input_ids"].tolist() and row["labels"] == pair[side]["labels"].tolist()
            )
    out = io.StringIO()
    preview(build_parser().parse_args([*common, "--no-color"]), out)
    assert "ASSISTANT: red</s>" in out.getvalue() and "ASSISTANT: ⟦circle</s>⟧" in out.getvalue()  # context, reply


def test_builtin_skills_pairs_prefer_the_suites_answer_to_a_wrong_one_of_its_kind(synthetic_tokenizer):
    """The canary's DPO pairs: each image question of the skills suite (text sums have no image), prompt and chosen
    as the suite's own finetuning record asks and answers it, rejected another answer of the same kind."""
    from neva.data.synthetic import COLORS, SHAPES
    from neva.data.synthetic_skills import make_record

    cfg = DataConfig(data_path="synthetic_skills_preference", conv_template="vicuna_v1", synthetic_val_samples=12)
    model = build_config(image_token_id=synthetic_tokenizer.convert_tokens_to_ids("<image>"))
    dm = PreferenceDataModule(cfg, synthetic_tokenizer, model, micro_batch_size=4)
    dm.setup()
    records = dm.val_datasets[0].base.records
    kinds = ({str(n) for n in range(5, 10)}, {"yes", "no"}, set(COLORS), set(SHAPES), {"first", "second"})
    indices = [int(r["id"].rsplit("-", 1)[1]) for r in records]
    assert len(records) == 12 and 4 not in indices and 9 not in indices  # held-out 4, 9, ...: text questions
    for r, i in zip(records, indices):
        asked = make_record(0, "val", i, "qa")
        assert r["prompt"] == asked["conversations"][0]["value"] and r["image"] == asked["image"]
        assert r["chosen"] == asked["conversations"][1]["value"] != r["rejected"]
        assert any({r["chosen"], r["rejected"]} <= kind for kind in kinds)
    batch = next(iter(dm.val_dataloader()))
    assert batch.stage.pairs == 4 and not batch.counts.skipped
