"""``neva.generate --video``: the file decoded by the loader's decoder at the checkpoint's ``num_frames``, answered as
the same frames decoded by PyAV's plain loop and given to the ``Answerer`` directly."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from neva.checkpoint.neva_format import save_checkpoint
from neva.data.synthetic import build_tokenizer
from neva.evaluate import main as evaluate_main
from neva.generate import main as generate_main
from neva.inference import Answerer
from neva.models.generation import GenerationConfig
from neva.models.neva import NevaModel
from neva.models.presets import build_config
from neva.models.video import VideoConfig
from tests.checkpoint.tiny_hf import one_thread
from tests.data.video_files import reference_decode, write_video

NUM_FRAMES, TOTAL, NEW_TOKENS = 3, 10, 5


@pytest.fixture(scope="module")
def video_checkpoint(tmp_path_factory):
    """A random tiny video model (2 × 2 pooling) trained, says its metadata, on 3 frames; a 10-frame mp4."""
    root = tmp_path_factory.mktemp("generate_video")
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    cfg = build_config(vocab_size=len(tokenizer), image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    model = NevaModel(dataclasses.replace(cfg, video=VideoConfig(spatial_pool_stride=2)))
    model.init_weights()
    meta = {"conv_template": "vicuna_v1", "num_frames": NUM_FRAMES}
    save_checkpoint(root / "ckpt", model.cfg, model.state_dict(), tokenizer, metadata=meta)
    return root / "ckpt", write_video(root / "clip.mp4", TOTAL)


@one_thread()
def test_generate_video_answers_the_checkpoints_frames(video_checkpoint, capsys):
    ckpt, clip = video_checkpoint
    prompt = "Which way does it move?"
    generate_main(["--checkpoint", str(ckpt), "--device", "cpu", "--video", clip, "--prompt", prompt,
                   "--max-new-tokens", str(NEW_TOKENS)])  # fmt: skip
    printed = capsys.readouterr().out.rstrip("\n")
    indices = np.linspace(0, TOTAL - 1, NUM_FRAMES, dtype=int).tolist()  # LLaVA-NeXT-Video's uniform sampling
    frames = np.stack(reference_decode(clip, indices))
    answerer = Answerer(ckpt, GenerationConfig(max_new_tokens=NEW_TOKENS))
    assert np.array_equal(answerer.read_video(clip), frames) and frames.shape == (NUM_FRAMES, 32, 32, 3)
    assert printed == answerer.answer([(prompt, [], [frames])])[0]
    # a different frame count gives other positions: the answer is not the same input in disguise
    assert answerer.prepare((prompt, [], [frames[:1]]))[0] != answerer.prepare((prompt, [], [frames]))[0]


def test_generate_video_bad_file_exits_with_the_skip_reason(video_checkpoint, tmp_path, capsys):
    ckpt, _ = video_checkpoint
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"not a video at all" * 10)
    with pytest.raises(SystemExit) as stop:
        generate_main(["--checkpoint", str(ckpt), "--device", "cpu", "--video", str(bad), "--prompt", "x"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: --video ") and "corrupt_video" in err, err


@one_thread()
def test_evaluate_video_suite_asks_the_held_out_clips_at_the_checkpoints_frames(video_checkpoint, tmp_path, capsys,
                                                                                 monkeypatch):  # fmt: skip
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the clips are written into the cache
    try:
        evaluate_main(["--checkpoint", str(video_checkpoint[0]), "--suite", "video", "--limit", "6",
                       "--max-new-tokens", "2"])  # fmt: skip
    finally:
        torch.set_grad_enabled(True)  # neva.evaluate turns autograd off for its process
    result = json.loads(capsys.readouterr().out)
    assert result["n"] == 6 and result["num_frames"] == NUM_FRAMES and 0.0 <= result["accuracy"] <= 1.0
    assert set(result["per_kind"]) == {"motion", "start_color", "end_color"}
    assert all({"ci95", "chance", "swapped", "no_image"} <= set(row) for row in result["per_kind"].values())
    assert set(result["controls"]) == {"swapped", "no_image"}
    assert len(list(tmp_path.rglob("*.mp4"))) == 6


@one_thread()
def test_generate_input_file_answers_video_records_and_names_bad_ones(video_checkpoint, tmp_path):
    """Batch mode: a record's ``video`` (relative to the JSONL's folder) decoded as ``--video`` decodes it, answered
    as the Answerer answers those frames; a corrupt video is that record's error, the rest answered."""
    ckpt, clip = video_checkpoint
    (tmp_path / "bad.mp4").write_bytes(b"not a video at all" * 10)
    records = [{"id": "v", "prompt": "<video>\nWhich way?", "video": clip}, {"id": "t", "prompt": "Hello?"},
               {"id": "bad", "prompt": "Which way?", "video": ["bad.mp4"]}]  # fmt: skip
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(SystemExit) as stop:
        generate_main(["--checkpoint", str(ckpt), "--device", "cpu", "--input-file", str(tmp_path / "in.jsonl"),
                       "--output-file", str(tmp_path / "out.jsonl"), "--max-new-tokens", str(NEW_TOKENS)])  # fmt: skip
    assert stop.value.code == 1
    rows = {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    answerer = Answerer(ckpt, GenerationConfig(max_new_tokens=NEW_TOKENS))
    frames = answerer.read_video(clip)
    assert rows["v"]["answer"] == answerer.answer([(records[0]["prompt"], [], [frames])])[0]
    assert rows["t"]["answer"] == answerer.answer([("Hello?", [])])[0]
    assert "corrupt_video" in rows["bad"]["error"] and "answer" not in rows["bad"]
