"""Image decoding and per-tower preprocessing, pixel-identical to the tower's transformers image processor.

Each tower family brings its own fit to the square input (``TowerSpec.fit``, ``neva.families``):

* CLIP (``CLIPImageProcessor``): RGB → bicubic resize of the shortest edge to ``image_size`` (PIL, long edge
  ``int(size*long/short)``) → centre crop ``image_size`` × ``image_size`` (top/left = ``(dim - size) // 2``).
* SigLIP (``SiglipImageProcessor``): RGB → bicubic resize of the whole image to ``image_size`` × ``image_size`` (the
  aspect ratio is not kept; no crop).

then ``/255`` → ``(x - mean) / std`` with the tower's statistics (CLIP's, SigLIP's 0.5). The geometric part runs
here, in the loader's workers, and yields uint8 pixels; ``/255`` and the mean/std normalisation run on the device, in
fp32, inside the vision tower (``neva.models.vision.normalize_pixels``). ``image_aspect_ratio=pad`` (LLaVA's
``expand2square``) fills with the tower's own mean colour before the fit; ``keep`` letterboxes with it instead.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
import threading
import warnings
from collections.abc import Callable
from typing import Any, BinaryIO

import numpy as np
import torch
from PIL import Image

from neva.constants import MAX_IMAGE_PIXELS
from neva.data.errors import SampleError
from neva.families import part
from neva.models.config import VisionConfig


class ImageError(SampleError):
    """An image that cannot be used."""


def resize_shortest_and_crop(image: Image.Image, size: int) -> np.ndarray:
    """CLIP's fit: bicubic resize of the shortest edge to ``size``, then the centre ``size`` × ``size`` crop."""
    w, h = image.size
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = size, int(size * long / short)
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    arr = np.asarray(image.resize((new_w, new_h), resample=Image.BICUBIC))
    top, left = (new_h - size) // 2, (new_w - size) // 2
    return arr[top : top + size, left : left + size]


def resize_square(image: Image.Image, size: int) -> np.ndarray:
    """SigLIP's fit: bicubic resize of the whole image to ``size`` × ``size``."""
    return np.asarray(image.resize((size, size), resample=Image.BICUBIC))


class ImageProcessor:
    """One tower's preprocessing (its family's ``fit``: RGB image → uint8 ``[size, size, 3]`` as its HF image
    processor; its mean as fill colour) for one ``image_aspect_ratio``."""

    def __init__(self, vision: VisionConfig, aspect_ratio: str = "square") -> None:
        if aspect_ratio not in ("square", "pad", "keep"):
            raise ValueError(f"image_aspect_ratio must be square, pad or keep, got {aspect_ratio!r}")
        self.size = vision.image_size
        self.aspect_ratio = aspect_ratio
        self.fit: Callable[[Image.Image, int], np.ndarray] = part(vision.spec.fit)
        # LLaVA's expand2square fills with tuple(int(x * 255) for x in image_mean): truncation, not rounding.
        self.fill = tuple(int(x * 255) for x in vision.image_mean)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        """PIL image (any mode) → uint8 ``[3, size, size]`` (resized and cropped, not yet normalised)."""
        image = image.convert("RGB")
        if self.aspect_ratio == "pad":
            image = expand_to_square(image, self.fill)
        elif self.aspect_ratio == "keep":
            return _chw(self._keep(image))
        return _chw(self.fit(image, self.size))

    def _keep(self, image: Image.Image) -> np.ndarray:
        # The whole image stays visible: longer side → size, the rest filled with the mean colour (no crop).
        w, h = image.size
        scale = self.size / max(w, h)
        new_w, new_h = max(1, round(w * scale)), max(1, round(h * scale))
        canvas = Image.new("RGB", (self.size, self.size), self.fill)
        canvas.paste(
            image.resize((new_w, new_h), resample=Image.BICUBIC), ((self.size - new_w) // 2, (self.size - new_h) // 2)
        )
        return np.asarray(canvas)


def _chw(arr: np.ndarray) -> torch.Tensor:
    """``[H, W, 3]`` uint8 array → contiguous uint8 ``[3, H, W]`` tensor."""
    return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))


def expand_to_square(image: Image.Image, fill: tuple[int, int, int]) -> Image.Image:
    """LLaVA's ``expand2square``: paste the image centred on a square canvas of colour ``fill``."""
    w, h = image.size
    if w == h:
        return image
    side = max(w, h)
    canvas = Image.new(image.mode, (side, side), fill)
    canvas.paste(image, ((side - w) // 2, (side - h) // 2))
    return canvas


def decode_image(data: bytes, name: str, max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """Bytes → fully decoded RGB PIL image, if it has at most ``max_pixels`` pixels.

    The size is read from the header before anything is decoded. PIL's own decompression-bomb check (a warning
    above ``Image.MAX_IMAGE_PIXELS``, an error above twice that) runs inside ``Image.open``, before ours can: its
    warning is silenced because ``max_pixels`` decides, and its error is reported as ``image_too_large`` too.

    Raises:
        ImageError: ``image_too_large`` or ``corrupt_image``.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:
        raise ImageError("image_too_large", f"{name}: {exc}") from exc
    except Exception as exc:  # PIL raises many types (OSError, SyntaxError, ValueError)
        raise ImageError("corrupt_image", f"{name}: {type(exc).__name__}: {exc}") from exc
    with img:
        w, h = img.size
        if w * h > max_pixels:
            raise ImageError(
                "image_too_large", f"{name}: {w}x{h} = {w * h:,} pixels > model.data.max_image_pixels {max_pixels:,}"
            )
        try:
            img.load()
            return img.convert("RGB")
        except Exception as exc:
            raise ImageError("corrupt_image", f"{name}: {type(exc).__name__}: {exc}") from exc


def safe_relative_path(name: Any) -> str:
    """Normalise a record's image path; refuse absolute paths and paths escaping the image folder.

    Raises:
        ImageError: ``unsafe_image_path``.
    """
    if not isinstance(name, str) or not name or "\x00" in name:
        raise ImageError("unsafe_image_path", f"invalid image path {name!r}")
    if os.path.isabs(name) or name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        raise ImageError("unsafe_image_path", f"absolute image path {name!r}")
    norm = os.path.normpath(name.replace("\\", "/"))
    if norm == ".." or norm.startswith("../"):
        raise ImageError("unsafe_image_path", f"image path {name!r} escapes the image folder")
    return norm


class ImageSource:
    """Loads images named by records; subclasses read a folder, a tar or generate them."""

    def load(self, name: str) -> Image.Image:
        """The image called ``name`` (decoded RGB). Raises ``ImageError``."""
        raise NotImplementedError

    def size(self, name: str) -> tuple[int, int]:
        """``(height, width)`` of the image called ``name``, without decoding it where the source can (AnyRes
        length grouping). Raises ``ImageError``."""
        w, h = self.load(name).size
        return h, w


class FolderImageSource(ImageSource):
    """Images under a directory; symlinks pointing out of it are refused too, and so is anything but a regular file.

    Args:
        root: the image folder.
        max_pixels: ``model.data.max_image_pixels``.
    """

    def __init__(self, root: str, max_pixels: int = MAX_IMAGE_PIXELS) -> None:
        self.root = os.path.realpath(root)
        self.max_pixels = max_pixels

    def load(self, name: str) -> Image.Image:
        return decode_image(self.read_bytes(name), name, self.max_pixels)

    def size(self, name: str) -> tuple[int, int]:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                with Image.open(io.BytesIO(self.read_bytes(name))) as img:  # the header only: no decode
                    w, h = img.size
        except ImageError:
            raise
        except Exception as exc:  # PIL raises many types; the sample's own load reports it as it should
            raise ImageError("corrupt_image", f"{name}: {type(exc).__name__}: {exc}") from exc
        return h, w

    def read_bytes(self, name: str) -> bytes:
        """The file's bytes, undecoded (``make_shards`` copies them into shards as they are).

        Raises:
            ImageError: ``unsafe_image_path``, ``missing_image`` or ``not_regular_file``.
        """
        return read_regular_file(resolve_in_folder(self.root, name), name, f" in {self.root}")


def resolve_in_folder(root: str, name: Any) -> str:
    """The real path of a record's ``name`` under the real path ``root``; symlinks out of it are refused.

    Raises:
        ImageError: ``unsafe_image_path``.
    """
    rel = safe_relative_path(name)
    path = os.path.realpath(os.path.join(root, rel))
    if not path.startswith(os.path.join(root, "")):  # root plus one separator, also when root is "/"
        raise ImageError("unsafe_image_path", f"{name!r} resolves outside the image folder")
    return path


def read_regular_file(path: str, name: str, where: str = "") -> bytes:
    """The bytes of the regular file at ``path`` (``name`` and ``where`` for messages).

    Raises:
        ImageError: ``missing_image`` or ``not_regular_file``.
    """
    with open_regular_file(path, name, where) as f:
        try:
            return f.read()
        except OSError as exc:
            raise ImageError("missing_image", f"{name}: {exc}") from exc


def open_regular_file(path: str, name: str, where: str = "") -> BinaryIO:
    """The regular file at ``path``, open for binary reading (``read_regular_file``'s checks).

    Raises:
        ImageError: ``missing_image`` or ``not_regular_file``.
    """
    try:
        # Non-blocking open, then fstat of what was opened: a named pipe would block a blocking open (and a read)
        # forever, and checking the type before opening would leave a window to swap the file.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError as exc:
        raise ImageError("missing_image", f"{name} not found{where}") from exc
    except OSError as exc:
        raise ImageError("missing_image", f"{name}: {exc}") from exc
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "directory" if stat.S_ISDIR(mode) else "named pipe" if stat.S_ISFIFO(mode) else "special file"
        raise ImageError("not_regular_file", f"{name} is a {kind}, not a regular file")
    return os.fdopen(fd, "rb")


class TarImageSource(ImageSource):
    """Images inside one ``.tar``; reopened per process because DataLoader workers fork a shared file offset."""

    def __init__(self, path: str, max_pixels: int = MAX_IMAGE_PIXELS) -> None:
        self.path = path
        self.max_pixels = max_pixels
        self._pid = -1
        self._lock = threading.Lock()
        self._tar: tarfile.TarFile | None = None
        self._members: dict[str, tarfile.TarInfo] = {}

    def _open(self) -> None:
        if self._pid != os.getpid():
            self._tar = tarfile.open(self.path, "r")  # noqa: SIM115 (kept open for the process lifetime)
            self._members = {os.path.normpath(m.name): m for m in self._tar.getmembers() if m.isfile()}
            self._pid = os.getpid()

    def load(self, name: str) -> Image.Image:
        rel = safe_relative_path(name)
        with self._lock:
            self._open()
            member = self._members.get(rel)
            if member is None:
                raise ImageError("missing_image", f"{name} not in {self.path}")
            data = self._tar.extractfile(member).read()
        return decode_image(data, name, self.max_pixels)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_tar=None, _members={}, _pid=-1, _lock=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


class CallableImageSource(ImageSource):
    """Images produced by a function of the name (synthetic data, tests)."""

    def __init__(self, fn: Callable[[str], Image.Image]) -> None:
        self.fn = fn

    def load(self, name: str) -> Image.Image:
        try:
            return self.fn(name).convert("RGB")
        except KeyError as exc:
            raise ImageError("missing_image", f"{name} unknown") from exc


class NoImageSource(ImageSource):
    """No ``image_folder`` configured: any record with an image is skipped as missing."""

    def load(self, name: str) -> Image.Image:
        safe_relative_path(name)
        raise ImageError("missing_image", f"{name}: no model.data.image_folder configured")


def image_source_for(image_folder: str | None, max_pixels: int = MAX_IMAGE_PIXELS) -> ImageSource:
    """Folder, ``.tar`` or none."""
    if image_folder is None:
        return NoImageSource()
    if os.path.isfile(image_folder) and image_folder.endswith(".tar"):
        return TarImageSource(image_folder, max_pixels)
    return FolderImageSource(image_folder, max_pixels)
