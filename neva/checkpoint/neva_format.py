"""The neva checkpoint directory: typed config + safetensors weights under neva's own keys + tokenizer files.

Layout::

    CKPT/
      config.json                  {"format": "neva", "version": 1, "model": <NevaConfig dict>, "dtype": ..., ...}
      model.safetensors            or model-0000K-of-0000N.safetensors + model.safetensors.index.json
      tokenizer.json, tokenizer_config.json, ...   (top level, so AutoTokenizer.from_pretrained(CKPT) works)

Weights stream in and out tensor by tensor; a checkpoint appears under its final name only once complete (it is
written to ``CKPT.tmp-*`` and renamed). Tied word embeddings are stored once (as ``llm.tok_embeddings.weight``), as
HF does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from neva.checkpoint.atomic import atomic_directory
from neva.checkpoint.safetensors_io import (
    DEFAULT_MAX_SHARD_BYTES,
    ShardWriter,
    iter_safetensors,
    safetensors_files,
    safetensors_shapes,
)
from neva.config import TrainConfig
from neva.models.config import NevaConfig, from_dict, to_dict
from neva.models.neva import NevaModel
from neva.typed import ConfigError

FORMAT_NAME = "neva"
FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
TIED_HEAD_KEY = "llm.output.weight"
_RESERVED = {"format", "version", "model", "dtype"}
# The data settings a checkpoint records for inference, export and the stages after it (template, system prompt, image
# handling; a native tower's pixel budget, so serving and exports resize as training did; video: the frames a video is
# sampled to, so `neva.generate --video` and `neva.evaluate --suite video` decode as trained). A later stage takes them
# where it sets none itself (neva.checkpoint.trained_with).
RUN_DATA_KEYS = ("conv_template", "system_prompt", "use_chat_template", "image_aspect_ratio", "tokenization")
RUN_DATA_KEYS += ("num_frames", "video_fps", "min_pixels", "max_pixels")

TensorSource = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def run_metadata(cfg: TrainConfig) -> dict[str, Any]:
    """What a run's checkpoint records beside its weights: the stage, the data settings inference and export serve
    with (``RUN_DATA_KEYS``), and the precision the export's default dtype follows."""
    data = {k: getattr(cfg.model.data, k) for k in RUN_DATA_KEYS}
    return {"stage": cfg.stage, **data, "precision": str(cfg.trainer.precision)}


def tensor_pairs(tensors: TensorSource) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` pairs from a state dict or an iterator of pairs."""
    return iter(tensors.items()) if isinstance(tensors, Mapping) else iter(tensors)


def expected_shapes(cfg: NevaConfig) -> dict[str, torch.Size]:
    """Every tensor a complete checkpoint of ``cfg`` holds, with its shape (built on meta: no memory)."""
    with torch.device("meta"):
        model = NevaModel(cfg)
    shapes = {key: value.shape for key, value in model.state_dict().items()}
    if cfg.llm.tie_word_embeddings:
        shapes.pop(TIED_HEAD_KEY)
    return shapes


def check_shape(key: str, shape: Any, expected: Any, source: Any, grows: bool = False) -> None:
    """The one shape check of every weight load: ``copy_`` would broadcast a size-1 tensor into a whole parameter, and
    a plain mismatch fails without naming the tensor.

    Args:
        grows: the tensor may have fewer rows than ``expected`` (an HF embedding the import extends).

    Raises:
        ValueError: naming ``source``, the tensor and both shapes.
    """
    shape, expected = tuple(shape), tuple(expected)
    if shape == expected:
        return
    if grows and len(shape) == len(expected) and shape[1:] == expected[1:] and shape[0] <= expected[0]:
        return
    raise ValueError(f"{source}: tensor {key!r} has shape {shape}, the model expects {expected}")


def save_checkpoint(
    directory: str | os.PathLike,
    cfg: NevaConfig,
    tensors: TensorSource,
    tokenizer: Any = None,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a neva checkpoint, streaming: tensors are written shard by shard as the iterator yields them.

    Args:
        directory: checkpoint directory to create.
        cfg: the model config.
        tensors: a state dict or an iterator of ``(neva key, tensor)``; every key of ``cfg``'s model exactly once
            (``llm.output.weight`` is skipped when embeddings are tied).
        tokenizer: an HF tokenizer, or a directory holding one, saved at the top level; None = no tokenizer.
        max_shard_bytes: start a new ``model-*-of-*.safetensors`` shard beyond this size.
        metadata: extra JSON-able entries for ``config.json`` (e.g. ``{"image_aspect_ratio": "pad"}``).
        overwrite: replace an existing directory (only after the new one is complete).

    Returns:
        The checkpoint directory.

    Raises:
        FileExistsError: ``directory`` exists and ``overwrite`` is False.
        KeyError: a tensor the model does not have, or one missing.
        ValueError: a tensor of the wrong shape.
    """
    clash = _RESERVED & set(metadata or {})
    if clash:
        raise ValueError(f"metadata keys {sorted(clash)} are reserved")
    with atomic_directory(directory, overwrite) as tmp:
        dtypes = _write_weights(tmp, cfg, tensors, max_shard_bytes)
        dtype = str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else None
        config = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "model": to_dict(cfg), "dtype": dtype}
        config.update(metadata or {})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp)
    return Path(directory)


def _write_weights(directory: Path, cfg: NevaConfig, tensors: TensorSource, max_shard_bytes: int) -> set[torch.dtype]:
    shapes = expected_shapes(cfg)
    writer = ShardWriter(directory, max_shard_bytes)
    seen: set[str] = set()
    dtypes: set[torch.dtype] = set()
    for key, tensor in tensor_pairs(tensors):
        if key == TIED_HEAD_KEY and cfg.llm.tie_word_embeddings:
            continue
        if key not in shapes:
            raise KeyError(f"tensor {key!r} is not part of the model described by the config")
        check_shape(key, tensor.shape, shapes[key], "checkpoint being written")
        writer.add(key, tensor)
        seen.add(key)
        if tensor.is_floating_point():
            dtypes.add(tensor.dtype)
    missing = sorted(set(shapes) - seen)
    if missing:
        raise KeyError(f"{len(missing)} tensor(s) missing from the checkpoint, e.g. {missing[:5]}")
    writer.close()
    return dtypes


def save_tokenizer(tokenizer: Any, directory: str | os.PathLike) -> None:
    """Save an HF tokenizer (object, or directory to load one from) into ``directory``."""
    if isinstance(tokenizer, (str, os.PathLike)):
        from neva.data.sentencepiece_tokenizer import load_tokenizer as load_hf_tokenizer

        tokenizer = load_hf_tokenizer(tokenizer)
    tokenizer.save_pretrained(str(directory))


def read_config_file(directory: str | os.PathLike) -> dict[str, Any]:
    """The raw ``config.json`` of a neva checkpoint, format and version checked.

    Raises:
        ConfigError: not a neva checkpoint (no config.json; a NeMo one named as such), a config.json that is not JSON,
            or a newer format version.
    """
    refuse_nemo_checkpoint(directory)
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise ConfigError(f"{directory} is not a neva checkpoint directory (no {CONFIG_NAME})")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not JSON ({err})") from err
    if data.get("format") != FORMAT_NAME:
        raise ConfigError(
            f"{path} is not a neva checkpoint config (format={data.get('format')!r}); HF dirs need conversion"
        )
    if int(data.get("version", 0)) > FORMAT_VERSION:
        raise ConfigError(f"{path}: format version {data['version']} is newer than this neva ({FORMAT_VERSION})")
    return data


def nemo_checkpoint_note(path: str | os.PathLike) -> str | None:
    """What to do with a NeMo checkpoint (a ``.nemo`` file, or one extracted: ``model_config.yaml`` inside) given
    where neva expects its own or HF files; None when ``path`` is not one."""
    p = Path(path)
    if not (p.suffix == ".nemo" or (p / "model_config.yaml").is_file()):
        return None
    return (
        f"{path} is a NeMo checkpoint (.nemo), which neva does not read. Convert it to HF with NeMo's "
        "scripts/checkpoint_converters/convert_llava_nemo_to_hf.py (a NeVA model), then "
        "`python -m neva.convert hf-to-neva` and pass the output as model.restore_from_path (or as the checkpoint of "
        "neva.convert, neva.generate, neva.evaluate); or, for a NeMo LLM, convert_llama_nemo_to_hf.py and pass the "
        "HF directory as model.mm_cfg.llm.from_pretrained"
    )


def refuse_nemo_checkpoint(path: str | os.PathLike, what: str = "") -> None:
    """Stop with what to do when ``path`` (given as ``what``: a config key or a command-line option) is a NeMo
    checkpoint.

    Raises:
        ConfigError: ``path`` is a ``.nemo`` file or an extracted one.
    """
    if note := nemo_checkpoint_note(path):
        raise ConfigError(f"{what}: {note}" if what else note)


def is_neva_checkpoint(directory: str | os.PathLike) -> bool:
    """True if ``directory`` holds a neva-format ``config.json``."""
    try:
        return json.loads((Path(directory) / CONFIG_NAME).read_text()).get("format") == FORMAT_NAME
    except (OSError, ValueError):
        return False


def load_config(directory: str | os.PathLike) -> NevaConfig:
    """The checkpoint's ``NevaConfig`` (unknown keys are an error)."""
    return from_dict(NevaConfig, read_config_file(directory)["model"])


def load_metadata(directory: str | os.PathLike) -> dict[str, Any]:
    """Extra ``config.json`` entries saved with the checkpoint (plus ``dtype``)."""
    data = read_config_file(directory)
    return {k: v for k, v in data.items() if k not in ("format", "version", "model")}


def iter_tensors(directory: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(neva key, tensor)`` one at a time, shard by shard (memory-mapped)."""
    return iter_safetensors(safetensors_files(directory))


def tensor_shapes(directory: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Every stored tensor's name and shape, from the file headers (no tensor data is read)."""
    return safetensors_shapes(safetensors_files(directory))


@torch.no_grad()
def load_weights(model: NevaModel, directory: str | os.PathLike) -> None:
    """Copy a checkpoint's tensors into a whole ``model`` one by one (cast to each parameter's dtype and device).

    Also recomputes the non-persistent RoPE buffer, so a model fresh from ``to_empty`` is ready to run. Sharded and
    pipeline-stage models are not filled here: training loads those into each rank's parts itself.

    Args:
        model: a materialised, unsplit model (e.g. after ``to_empty``).
        directory: the checkpoint.

    Raises:
        KeyError: a stored tensor the model does not have, or a model tensor the checkpoint lacks (the output head
            of tied embeddings aside: it is the embedding).
        ValueError: a stored tensor whose shape is not the model's (all checked before anything is copied).
    """
    targets = model.state_dict()
    tied = model.cfg.llm.tie_word_embeddings and "llm.tok_embeddings.weight" in targets
    shapes = tensor_shapes(directory)
    for key, shape in shapes.items():
        if key not in targets:
            raise KeyError(f"checkpoint tensor {key!r} has no place in the model")
        check_shape(key, shape, targets[key].shape, directory)
    missing = sorted(set(targets) - set(shapes) - ({TIED_HEAD_KEY} if tied else set()))
    if missing:
        raise KeyError(f"{len(missing)} model tensor(s) not in {directory}, e.g. {missing[:5]}")
    for key, tensor in iter_tensors(directory):
        targets[key].copy_(tensor)
    model.llm.reset_rope()


def load_model(
    directory: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> NevaModel:
    """Build a ``NevaModel`` on the meta device, materialise it on ``device`` and load the checkpoint into it.

    Args:
        directory: the checkpoint.
        device: where the weights go.
        dtype: parameter dtype; None = the dtype the checkpoint was saved in (float32 if mixed).

    Returns:
        The model in eval mode.
    """
    cfg = load_config(directory)
    if dtype is None:
        stored = load_metadata(directory).get("dtype")
        dtype = getattr(torch, stored) if stored else torch.float32
    with torch.device("meta"):
        model = NevaModel(cfg)
    model.to(dtype=dtype)
    model.to_empty(device=device)
    llm = model.llm
    if cfg.llm.tie_word_embeddings and llm.output is not None and llm.tok_embeddings is not None:
        # to_empty replaces meta parameters module by module, which unties shared ones: tie them again.
        llm.output.weight = llm.tok_embeddings.weight
    load_weights(model, directory)
    return model.eval()


def load_tokenizer(directory: str | os.PathLike) -> Any:
    """The checkpoint's HF tokenizer (``<image>`` is one of its special tokens)."""
    from neva.data.sentencepiece_tokenizer import load_tokenizer as load_hf_tokenizer

    return load_hf_tokenizer(directory)
