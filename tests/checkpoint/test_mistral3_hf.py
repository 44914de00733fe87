"""Mistral 3 against transformers' own ``Mistral3ForConditionalGeneration`` (tiny random models written as hub
directories; two variants: a bias-free and a biased projector): import and export through `neva.convert` (the
family's Interop), neva's data path (LLaVA-format records → Pixtral patches → collate) equal to the processor's ids
(rows of ``[IMG]`` with ``[IMG_BREAK]`` / ``[IMG_END]``), pixels and token counts, whole-model logits on images of
several sizes (one scaled down to the longest edge, one scaled up to whole merged tokens), two images and text only,
packed rows equal to unpacked, greedy generation on a left-padded batch, export → reload."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from PIL import Image

from neva.checkpoint.neva_format import load_metadata
from neva.convert import main as convert_main
from neva.data.collate import collate_packed, collate_padded
from neva.data.conversation import parse_conversations
from neva.data.dataset import process_record
from neva.data.images import FolderImageSource
from neva.data.templates.base import Message
from neva.models.native_vision import normalize_patches
from tests.checkpoint.tiny_hf import one_thread
from tests.checkpoint.tiny_mistral3 import MERGE, PATCH, hf_inputs, tiny_mistral3_dir
from tests.fixtures.data_path import checkpoint_data_path
from tests.fixtures.tiny_qwen_vl import write_image
from tests.models.test_hf_parity import rel_err

# (width, height) → resized (a multiple of 8 px per side, the longer side at most 64 px): 40×24, 64×32 (scaled
# down), 24×32 (rounded up), 16×16 (an odd size rounded up)
SIZES = {"a.png": (40, 24), "b.png": (100, 50), "c.png": (20, 30), "d.png": (13, 9)}
RECORDS = [
    {"id": "one", "image": "a.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A red circle."}]},
    {"id": "two", "image": ["b.png", "d.png"], "conversations": [
        {"from": "human", "value": "Compare <image> and <image> please."}, {"from": "gpt", "value": "Same colour."},
        {"from": "human", "value": "Sure?"}, {"from": "gpt", "value": "Yes."}]},
    {"id": "tall", "image": "c.png", "conversations": [
        {"from": "human", "value": "<image>\nDescribe."}, {"from": "gpt", "value": "Tall."}]},
    {"id": "text", "conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "Hi."}]},
]  # fmt: skip


@pytest.fixture(scope="module", params=["mistral3", "mistral3_bias"])
def imported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    for i, (name, size) in enumerate(SIZES.items()):
        write_image(root / "images" / name, size, seed=i)
    with one_thread():
        hf_dir = tiny_mistral3_dir(root, request.param)
        convert_main(["hf-to-neva", "--hf", str(hf_dir), "--out", str(root / "neva")])  # through the family's Interop
    return request.param, root, hf_dir, root / "neva"


def _samples(ckpt, root):
    model, tokenizer, settings, front_end = checkpoint_data_path(ckpt, max_length=1024)
    source = FolderImageSource(str(root / "images"))
    samples = [process_record(r, settings, source, front_end) for r in RECORDS]
    for record, sample in zip(RECORDS, samples):  # the length estimate from image headers: the spans encoded
        grid = sample.get("image_grid", torch.zeros(0, 3, dtype=torch.long))
        spans = sum((h // MERGE) * (w // MERGE + 1) for _, h, w in grid.tolist())
        assert front_end.record_tokens(record, source) == spans, record["id"]
    return model, tokenizer, settings, samples


def _images(root, record):
    names = record.get("image", [])
    names = [names] if isinstance(names, str) else names
    return names, [Image.open(root / "images" / n).convert("RGB") for n in names]


def _logits(model, batch):
    return model(batch.input_ids, batch.media, batch.position_ids, batch.segment_ids)


def _unpatch(patches, grid):
    """Merge-block-order patches ``[h·w, 3·P·P]`` of one image → its normalised pixels ``[3, h·P, w·P]``."""
    _, h, w = grid
    x = patches.view(h // MERGE, w // MERGE, MERGE, MERGE, 3, PATCH, PATCH)
    return x.permute(4, 0, 2, 5, 1, 3, 6).reshape(3, h * PATCH, w * PATCH)


def test_import_and_data_path_equal_transformers(imported):
    from transformers import AutoModelForImageTextToText

    _, root, hf_dir, ckpt = imported
    assert load_metadata(ckpt)["conv_template"] == "mistral3"
    with one_thread():
        hf = AutoModelForImageTextToText.from_pretrained(str(hf_dir)).eval()
        model, tokenizer, settings, samples = _samples(ckpt, root)
        for record, sample in zip(RECORDS, samples):
            assert "skipped" not in sample, sample
            _, images = _images(root, record)
            rendered = settings.template.render(parse_conversations(record["conversations"]))
            inputs = hf_inputs(tokenizer, rendered.text, images)
            ids = inputs["input_ids"][0].tolist()
            bos = [tokenizer.bos_token_id] if sample["input_ids"][0] == tokenizer.bos_token_id else []
            assert sample["input_ids"].tolist() == bos + ids
            inputs["input_ids"] = torch.tensor([bos + ids])
            if images:  # uint8 patches, normalised by the tower: the processor's pixels and sizes
                grid = sample["image_grid"]
                assert (grid[:, 1:] * PATCH).tolist() == inputs["image_sizes"].tolist()
                normed = normalize_patches(sample["pixel_values"], model.cfg.vision, torch.float32)
                for i, (patches, g) in enumerate(zip(normed.split((grid.prod(-1)).tolist()), grid.tolist())):
                    theirs = inputs["pixel_values"][i, :, : g[1] * PATCH, : g[2] * PATCH]
                    assert (_unpatch(patches, g) - theirs).abs().max() < 1e-5, (record["id"], i)
            batch = collate_padded([sample], pad_id=0)
            with torch.no_grad():
                ours = _logits(model, batch)[0, : sample["input_ids"].numel()]
                theirs = hf(**inputs).logits[0]
            assert rel_err(ours, theirs) < 1e-5, (record["id"], rel_err(ours, theirs))


def test_packed_row_equals_each_sample_alone(imported):
    _, root, _, ckpt = imported
    with one_thread():
        model, _, _, samples = _samples(ckpt, root)
        packed = collate_packed(samples, pad_id=0, seq_length=1024)
        assert packed.input_ids.shape[0] == 1  # one row holds them all
        with torch.no_grad():
            row = _logits(model, packed)[0]
            start = 0
            for sample in samples:
                n = sample["input_ids"].numel()
                alone = _logits(model, collate_padded([sample], pad_id=0))[0, :n]
                assert rel_err(row[start : start + n], alone) < 1e-5
                start += n


def test_export_reloads_in_transformers_with_identical_logits(imported, tmp_path):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    variant, root, hf_dir, ckpt = imported
    with one_thread():
        convert_main(["neva-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "export")])
        out = tmp_path / "export"
        assert json.loads((out / "config.json").read_text())["model_type"] == "mistral3"
        a = AutoModelForImageTextToText.from_pretrained(str(hf_dir)).eval()
        b = AutoModelForImageTextToText.from_pretrained(str(out)).eval()
        processor = AutoImageProcessor.from_pretrained(str(out))
        assert processor.size["longest_edge"] == 64
        assert json.loads((out / "processor_config.json").read_text())["spatial_merge_size"] == MERGE
        tokenizer = AutoTokenizer.from_pretrained(str(out))
        chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hello"}]}]
        text = tokenizer.apply_chat_template(chat, tokenize=False)
        assert text == "<s>[INST][IMG]hello[/INST]"
        image = Image.open(root / "images/b.png").convert("RGB")
        inputs = hf_inputs(tokenizer, text.removeprefix("<s>"), [image])
        with torch.no_grad():
            assert torch.equal(a(**inputs).logits, b(**inputs).logits), variant


def test_fields_neva_does_not_build_are_refused_by_name(imported):
    from neva.checkpoint.hf_mistral3 import neva_config_from_mistral3
    from neva.typed import ConfigError

    _, _, hf_dir, _ = imported
    hf = json.loads((hf_dir / "config.json").read_text())
    neva_config_from_mistral3(hf)  # as written: read
    bad = dict(hf, vision_feature_layer=-2, vision_config=dict(hf["vision_config"], attention_dropout=0.1, foo=1))
    with pytest.raises(ConfigError, match=r"vision_feature_layer=-2"):
        neva_config_from_mistral3(bad)
    with pytest.raises(ConfigError, match=r"attention_dropout=0\.1 .*; foo=1 \(unknown to neva"):
        neva_config_from_mistral3(dict(bad, vision_feature_layer=-1))


def test_an_image_processor_of_another_longest_edge_is_refused(imported, tmp_path):
    from neva.checkpoint.hf_mistral3 import MISTRAL3_INTEROP
    from neva.typed import ConfigError

    _, _, hf_dir, _ = imported
    other = tmp_path / "other"
    other.mkdir()
    for f in hf_dir.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    pre = json.loads((other / "preprocessor_config.json").read_text())
    (other / "preprocessor_config.json").write_text(json.dumps(dict(pre, size={"longest_edge": 96})))
    with pytest.raises(ConfigError, match=r"longest_edge=96 differs from vision_config.image_size=64"):
        MISTRAL3_INTEROP.import_dir(other, tmp_path / "out")


def test_greedy_generation_equals_transformers(imported):
    from transformers import AutoModelForImageTextToText

    from neva.inference import Answerer
    from neva.models.generation import GenerationConfig
    from tests.checkpoint.tiny_mistral3 import image_processor

    _, root, hf_dir, ckpt = imported
    with one_thread():
        hf = AutoModelForImageTextToText.from_pretrained(str(hf_dir)).eval()
        answerer = Answerer(ckpt, GenerationConfig(max_new_tokens=6))
        answerer.generation = dataclasses.replace(answerer.generation, eos_token_ids=(), stop_strings=())
        # a two-image prompt, a one-image prompt and a text-only one in one left-padded batch
        items = [("<image> then <image>: same?", [root / "images/b.png", root / "images/d.png"]),
                 ("<image>\nWhat is it?", [root / "images/a.png"]), ("Say hi.", [])]  # fmt: skip
        prepared = [answerer.prepare(item) for item in items]
        ours = answerer.generate_ids(prepared)
        render = answerer.builder.template.render_prompt
        bos = answerer.tokenizer.bos_token_id
        rows, images = [], []
        for p, (prompt, paths) in zip(prepared, items):
            loaded = [Image.open(path).convert("RGB") for path in paths]
            inputs = hf_inputs(answerer.tokenizer, render([Message("user", prompt)]), loaded)
            assert [bos] + inputs["input_ids"][0].tolist() == p.ids
            rows.append(p.ids)
            images += loaded
        # transformers on the same left-padded batch, the images padded to one size as its processor pads them
        pixels = image_processor()(images=images, patch_size={"height": PATCH * MERGE, "width": PATCH * MERGE},
                                   return_tensors="pt")  # fmt: skip
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        out = hf.generate(input_ids=ids, attention_mask=mask, pixel_values=pixels["pixel_values"],
                          image_sizes=pixels["image_sizes"], max_new_tokens=6, do_sample=False, eos_token_id=None,
                          pad_token_id=0)  # fmt: skip
        assert ours == out[:, width:].tolist()
        # --raw: the prompt as given, each <image> tag written as the processor writes an image ([IMG] rows)
        raw = Answerer(ckpt, GenerationConfig(max_new_tokens=6), raw=True)
        raw.generation = answerer.generation
        text = "[INST]<image>\nWhat is it?[/INST]"
        prepared = raw.prepare((text, [root / "images/c.png"]))
        inputs = hf_inputs(raw.tokenizer, text.replace("<image>", "[IMG]"), [Image.open(root / "images/c.png")])
        inputs["input_ids"] = torch.tensor([[bos] + inputs["input_ids"][0].tolist()])
        assert prepared.ids == inputs["input_ids"][0].tolist()
        out = hf.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert raw.generate_ids([prepared]) == [out[0, len(prepared.ids) :].tolist()]


def test_sizes_spans_and_the_planners_and_rehearsals_image_are_the_processors():
    """neva's resize rule (data path, serving, planner and rehearsal alike) = ``PixtralImageProcessorPil``'s image
    sizes at patch × merge, over sizes on both sides of the longest edge and of whole merged tokens; the spans are
    ``PixtralProcessor``'s image text; the planner's image load and the rehearsal's sample are the data path's."""
    from neva.checkpoint.architecture import neva_config_from_mm
    from neva.config import compose_config
    from neva.data.dataset import ConversationDataset, EncoderSettings
    from neva.data.images import CallableImageSource, ImageError
    from neva.data.pixtral_images import PixtralImages, PixtralImageSpec
    from neva.data.synthetic import build_tokenizer
    from neva.data.templates.registry import get_template
    from neva.data.tokens import add_special_tokens
    from neva.parallel.layout import Layout
    from neva.planner.plan import plan_run
    from neva.training.rehearsal_inputs import synthetic_micro_batches
    from tests.checkpoint.tiny_mistral3 import EDGE, image_processor, mistral3_tokenizer

    spec, processor, tok = PixtralImageSpec(PATCH, MERGE, EDGE), image_processor(), mistral3_tokenizer()
    for h in (7, 8, 9, 33, 64, 65, 130):
        for w in (3, 8, 17, 64, 100, 200):
            image = Image.new("RGB", (w, h))
            theirs = processor(images=[image], patch_size={"height": PATCH * MERGE, "width": PATCH * MERGE})
            assert list(spec.resized_size(h, w)) == list(theirs["image_sizes"][0]), (h, w)
            assert spec.span(h, w) == hf_inputs(tok, "[IMG]", [image])["input_ids"].numel(), (h, w)
    with pytest.raises(ImageError, match="below one merged token"):  # HF's resize fails on it: refused, counted
        spec.patches(Image.new("RGB", (200, 1)))

    # the tiny model's data path: an image of 24 x 40 px → 32 x 48 px, 2 x 3 merged tokens of 8 px patches
    cfg = compose_config(["+stage=finetune", "model=tiny_mistral3", "vision=tiny_pixtral", "cluster=dgx_a100",
                          "trainer.devices=1", "model.global_batch_size=1", "model.micro_batch_size=1"])  # fmt: skip
    tokenizer = build_tokenizer()
    add_special_tokens(tokenizer, ["[IMG_BREAK]", "[IMG_END]"])
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    ncfg = neva_config_from_mm(cfg.model.mm_cfg, len(tokenizer), image_id, cfg.model.data.image_aspect_ratio)
    ncfg = dataclasses.replace(ncfg, image_break_token_id=len(tokenizer) - 2, image_end_token_id=len(tokenizer) - 1)
    record = {"id": 0, "image": "a.png",
              "conversations": [{"from": "human", "value": "<image>\nwhat is it"}, {"from": "gpt", "value": "two"}]}  # fmt: skip
    settings = EncoderSettings(tokenizer=tokenizer, template=get_template("mistral", tokenizer),
                               image_token_id=image_id, num_image_tokens=0, max_length=1024)  # fmt: skip
    source = CallableImageSource(lambda _: Image.new("RGB", (40, 24), (200, 10, 10)))
    sample = ConversationDataset([record], settings, source, PixtralImages(ncfg))[0]
    span = 2 * (3 + 1)
    text_tokens = sample["input_ids"].numel() - span
    fake = synthetic_micro_batches(cfg, ncfg, Layout.from_config(cfg.model, 1), text_tokens, 0.5, (32, 48))[0]
    image = fake.media.image
    assert torch.equal(image.grid, sample["image_grid"]) and image.pixels.shape == sample["pixel_values"].shape
    first = int(sample["image_positions"][0])  # the features skip each row's break, in the data and the rehearsal
    assert (image.positions[:, 1] - image.positions[0, 1]).tolist() == (sample["image_positions"] - first).tolist()
    planned = plan_run(cfg, text_tokens=text_tokens, model=ncfg, image_size=(24, 40))
    assert (planned.extra["image"]["tokens"], planned.extra["image"]["tiles"]) == (
        span,
        sample["pixel_values"].shape[0],
    )
    assert planned.seq_len == fake.input_ids.shape[1]


def test_module_name_layout_imports_the_same_tensors(imported, tmp_path):
    """transformers 5's module names (``model.vision_tower.``, ``model.multi_modal_projector.``,
    ``model.language_model.``, ``lm_head.weight``) import as the ``save_pretrained`` layout does."""
    from safetensors.torch import load_file, save_file

    from neva.checkpoint.hf_mistral3 import MISTRAL3_INTEROP
    from neva.checkpoint.neva_format import iter_tensors

    _, _, hf_dir, ckpt = imported
    renamed = tmp_path / "modules"
    renamed.mkdir()
    for f in hf_dir.iterdir():
        if f.suffix != ".safetensors":
            (renamed / f.name).write_bytes(f.read_bytes())
    names = {"language_model.model.": "model.language_model.", "language_model.lm_head.": "lm_head.",
             "vision_tower.": "model.vision_tower.", "multi_modal_projector.": "model.multi_modal_projector."}  # fmt: skip
    tensors = load_file(str(hf_dir / "model.safetensors"))
    moved = {
        next(new + k[len(old) :] for old, new in names.items() if k.startswith(old)): t for k, t in tensors.items()
    }
    save_file(moved, str(renamed / "model.safetensors"), metadata={"format": "pt"})
    again = MISTRAL3_INTEROP.import_dir(renamed, tmp_path / "again")
    assert all(a == b and torch.equal(x, y) for (a, x), (b, y) in zip(iter_tensors(ckpt), iter_tensors(again)))


def test_a_text_only_micro_batch_runs_the_tower_and_projector_with_zero_gradients(imported):
    """A rank without images (text rows, a context-parallel share without patches) runs the tower and the merger on
    zero patches, so every parameter gets a (zero) gradient, as data-parallel reductions need."""
    from neva.checkpoint.neva_format import load_model

    _, root, _, ckpt = imported
    with one_thread():
        model, _, _, samples = _samples(ckpt, root)
        model = load_model(ckpt).train()
        batch = collate_padded([samples[-1]], pad_id=0)  # the text-only record
        _logits(model, batch).float().pow(2).mean().backward()
    for name, p in [*model.vision.named_parameters(), *model.projector.named_parameters()]:
        assert p.grad is not None and not p.grad.any(), name
