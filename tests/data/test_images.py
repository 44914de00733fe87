"""Pixel parity with transformers' CLIPImageProcessor, aspect-ratio modes, image sources."""

from __future__ import annotations

import os
import struct
import tarfile
import threading
import warnings
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from neva.data.images import (
    FolderImageSource,
    ImageError,
    ImageProcessor,
    TarImageSource,
    expand_to_square,
    resolve_in_folder,
)
from neva.models.config import VisionConfig
from neva.models.vision import normalize_pixels
from tests.data.conftest import write_image


def clip_reference(size: int):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    return CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})


@pytest.mark.parametrize("size,patch", [(32, 8), (224, 14)])
@pytest.mark.parametrize("wh", [(50, 37), (37, 50), (64, 64), (17, 9)])
def test_pixel_parity_with_clip_image_processor(size, patch, wh):
    vision = VisionConfig(image_size=size, patch_size=patch)
    ref = clip_reference(size)
    img = Image.fromarray(np.random.default_rng(sum(wh)).integers(0, 256, (wh[1], wh[0], 3), dtype=np.uint8))
    ours = ImageProcessor(vision, "square")(img)
    theirs = torch.from_numpy(np.asarray(ref(img, return_tensors="np")["pixel_values"][0]))
    assert ours.dtype == torch.uint8 and ours.shape == (3, size, size)  # the loader's output; normalised on device
    torch.testing.assert_close(_normalized(ours, vision), theirs, rtol=0, atol=1e-6)
    # pad = LLaVA's expand2square with the processor's mean colour (×255, truncated), then the same processor
    fill = tuple(int(x * 255) for x in ref.image_mean)
    padded = torch.from_numpy(np.asarray(ref(expand_to_square(img, fill), return_tensors="np")["pixel_values"][0]))
    torch.testing.assert_close(_normalized(ImageProcessor(vision, "pad")(img), vision), padded, rtol=0, atol=1e-6)


def _normalized(pixels: torch.Tensor, vision: VisionConfig) -> torch.Tensor:
    return normalize_pixels(pixels[None], vision.image_mean, vision.image_std)[0]


def test_device_normalisation_equals_the_float64_cpu_recipe_for_every_byte(vision):
    """Every uint8 value of every channel: the fp32 normalisation in the vision tower gives the bits of the previous
    CPU pipeline (float64 rescale as transformers does, then fp32 ``(x - mean) / std``)."""
    arr = np.tile(np.arange(256, dtype=np.uint8)[:, None, None], (1, 1, 3))  # [256, 1, 3]
    x = (arr.astype(np.float64) * (1 / 255)).astype(np.float32)
    mean, std = np.asarray(vision.image_mean, np.float32), np.asarray(vision.image_std, np.float32)
    want = torch.from_numpy(np.ascontiguousarray(((x - mean) / std).transpose(2, 0, 1)))
    assert torch.equal(_normalized(torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1))), vision), want)


def test_pad_fill_is_mean_colour_and_keep_shows_everything(vision):
    img = Image.new("RGB", (40, 10), (255, 0, 0))
    padded = ImageProcessor(vision, "pad")(img)
    assert padded[:, 0, 0].tolist() == [122, 116, 104]
    kept = ImageProcessor(vision, "keep")(img)
    assert kept.shape == (3, 32, 32)
    assert (kept[0, 16, :] > 230).all()  # the whole width of the image is still there (no crop)


def test_grey_and_rgba_become_rgb(vision):
    proc = ImageProcessor(vision)
    assert proc(Image.new("L", (20, 20), 128)).shape == (3, 32, 32)
    assert proc(Image.new("RGBA", (20, 30), (1, 2, 3, 4))).shape == (3, 32, 32)


def test_folder_and_tar_sources(tmp_path):
    write_image(tmp_path / "imgs" / "sub" / "a.png")
    folder = FolderImageSource(str(tmp_path / "imgs"))
    assert folder.load("sub/a.png").size == (40, 30)
    with tarfile.open(tmp_path / "imgs.tar", "w") as tar:
        tar.add(tmp_path / "imgs" / "sub" / "a.png", arcname="sub/a.png")
    src = TarImageSource(str(tmp_path / "imgs.tar"))
    assert src.load("./sub/a.png").size == (40, 30)
    for name, reason in [
        ("sub/b.png", "missing_image"),
        ("../a.png", "unsafe_image_path"),
        ("/etc/passwd", "unsafe_image_path"),
    ]:
        for source in (folder, src):
            with pytest.raises(ImageError) as e:
                source.load(name)
            assert e.value.reason == reason


def test_folder_at_the_filesystem_root_reads_its_files(tmp_path):
    """An image folder of "/" (its files directly under it) is a folder like any other, not an escape."""
    write_image(tmp_path / "a.png")
    assert resolve_in_folder("/", str(tmp_path / "a.png").lstrip("/")) == os.path.realpath(tmp_path / "a.png")
    with pytest.raises(ImageError, match="escapes"):
        resolve_in_folder("/", "../etc/passwd")


def png_header_only(path, width: int, height: int) -> None:
    """A PNG that declares ``width`` × ``height`` and holds no pixel data: cheap to write, costly if decoded."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    )


def test_only_regular_files_are_opened(tmp_path):
    """A named pipe would block a reader forever (no writer ever comes): it is skipped at once."""
    folder = tmp_path / "imgs"
    folder.mkdir()
    os.mkfifo(folder / "pipe.png")
    (folder / "dir.png").mkdir()
    source = FolderImageSource(str(folder))
    result = {}

    def load(name):
        try:
            source.load(name)
        except ImageError as exc:
            result[name] = exc

    for name, kind in (("pipe.png", "named pipe"), ("dir.png", "directory")):
        worker = threading.Thread(target=load, args=(name,), daemon=True)
        worker.start()
        worker.join(timeout=20)
        assert not worker.is_alive(), f"loading {name} blocked"
        assert result[name].reason == "not_regular_file" and kind in result[name].detail


def test_pixel_cap_skips_before_decoding(tmp_path):
    """144 Mpx (over PIL's warning limit, under its error limit) and 400 Mpx (over both): both image_too_large,
    without PIL's warning and without decoding; model.data.max_image_pixels sets the cap."""
    folder = tmp_path / "imgs"
    folder.mkdir()
    png_header_only(folder / "huge.png", 12_000, 12_000)
    png_header_only(folder / "bomb.png", 20_000, 20_000)
    write_image(folder / "small.png")  # 40 × 30
    source = FolderImageSource(str(folder))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PIL's DecompressionBombWarning would fail the test
        for name in ("huge.png", "bomb.png"):
            with pytest.raises(ImageError) as e:
                source.load(name)
            assert e.value.reason == "image_too_large", e.value.detail
    with pytest.raises(ImageError) as e:
        source.load("huge.png")
    assert "12000x12000 = 144,000,000 pixels > model.data.max_image_pixels 64,000,000" in e.value.detail
    assert source.load("small.png").size == (40, 30)
    with pytest.raises(ImageError) as e:
        FolderImageSource(str(folder), max_pixels=1000).load("small.png")
    assert e.value.reason == "image_too_large" and "1,200 pixels > model.data.max_image_pixels 1,000" in e.value.detail


@pytest.mark.parametrize("wh", [(50, 37), (37, 50), (64, 64), (17, 9)])
def test_pixel_parity_with_siglip_image_processor(wh):
    """SigLIP: resize to the square (no crop), mean/std 0.5; ``pad`` fills with SigLIP's mean (127), not CLIP's."""
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    vision = VisionConfig(kind="siglip", hidden_act="gelu_pytorch_tanh", image_size=32, patch_size=8)
    ref = SiglipImageProcessorPil(size={"height": 32, "width": 32})
    img = Image.fromarray(np.random.default_rng(sum(wh)).integers(0, 256, (wh[1], wh[0], 3), dtype=np.uint8))
    for mode, given in (("square", img), ("pad", expand_to_square(img, (127, 127, 127)))):
        ours = ImageProcessor(vision, mode)(img)
        theirs = torch.from_numpy(np.asarray(ref(given, return_tensors="np")["pixel_values"][0]))
        assert ours.dtype == torch.uint8 and ours.shape == (3, 32, 32)
        torch.testing.assert_close(_normalized(ours, vision), theirs, rtol=0, atol=1e-6)
    assert ImageProcessor(vision, "pad").fill == (127, 127, 127)
    if wh[0] != wh[1]:  # keep: letterboxed with SigLIP's mean, the whole image visible
        kept = ImageProcessor(vision, "keep")(img)
        assert kept[:, 0, 0].tolist() == [127, 127, 127] or kept[:, -1, -1].tolist() == [127, 127, 127]
