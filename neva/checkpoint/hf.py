"""Hugging Face interop: llava-hf / Llama + CLIP directories → neva checkpoints, and neva → llava-hf.

Everything streams tensor by tensor (``safe_open`` / memory-mapped ``torch.load``), so a conversion never holds more
than one copy of the weights plus one output shard. Key names come from the flat tables in ``hf_keys``; configs from
``hf_config``. HF configs are read through ``AutoConfig`` because hub ``config.json`` files often omit fields that
transformers fills with defaults (llava-1.5-7b-hf's ``text_config`` has no ``hidden_size``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from neva.checkpoint.atomic import atomic_directory
from neva.checkpoint.hf_config import (
    hf_select_strategy,
    llava_config_dict,
    llm_config_from_hf,
    neva_config_from_llava,
    vision_config_from_hf,
)
from neva.checkpoint.hf_files import (
    export_chat_template,
    export_dtype,
    generation_eos_ids,
    make_transformers_4_readable,
    read_template_settings,
    template_settings,
    write_chat_template_files,
)
from neva.checkpoint.hf_keys import detect_prefixes, hf_key_to_neva, neva_key_to_hf
from neva.checkpoint.hf_moe import canonical_shapes, canonical_tensors, expert_groups, per_expert_tensors
from neva.checkpoint.hf_onevision import save_onevision_processor
from neva.checkpoint.hf_video import save_video_processor
from neva.checkpoint.neva_format import (
    TIED_HEAD_KEY,
    TensorSource,
    check_shape,
    expected_shapes,
    iter_tensors,
    load_config,
    load_metadata,
    save_checkpoint,
    tensor_pairs,
)
from neva.checkpoint.safetensors_io import (
    DEFAULT_MAX_SHARD_BYTES,
    INDEX_NAME,
    WEIGHTS_NAME,
    index_files,
    iter_safetensors,
    safetensors_shapes,
    write_safetensors,
)
from neva.constants import IMAGE_TOKEN
from neva.hf_local import from_local, model_dir
from neva.models.anyres import parse_aspect_ratio
from neva.models.config import NevaConfig, ProjectorConfig
from neva.models.projector import build_projector, init_projector

PAD_TOKEN = "<pad>"
BIN_NAME = "pytorch_model.bin"
BIN_INDEX_NAME = "pytorch_model.bin.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# HF tensors neva does not keep: rotary buffers of old checkpoints, CLIP's / SigLIP's text tower and contrastive heads,
# SigLIP's attention-pooling head (its contrastive image embedding; LLaVA reads hidden states and never runs it).
_IGNORED = re.compile(
    r"(rotary_emb\.inv_freq$|position_ids$|^text_model\.|^logit_scale$|^logit_bias$|^text_projection\.|"
    r"^visual_projection\.|^(model\.)?(vision_tower\.|vision_model\.)*head\.)"
)


# --------------------------------------------------------------------------------------------------------- reading


def hf_weight_files(directory: str | os.PathLike) -> list[Path]:
    """Weight files of an HF directory: safetensors (sharded or not), else ``pytorch_model.bin`` (sharded or not).

    Raises:
        FileNotFoundError: none of them exists.
    """
    directory = Path(directory)
    for index_name, single in ((INDEX_NAME, WEIGHTS_NAME), (BIN_INDEX_NAME, BIN_NAME)):
        if (directory / index_name).is_file():
            return index_files(directory / index_name)
        if (directory / single).is_file():
            return [directory / single]
    raise FileNotFoundError(f"no {WEIGHTS_NAME}, {INDEX_NAME}, {BIN_NAME} or {BIN_INDEX_NAME} in {directory}")


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    # mmap keeps the file on disk and pages tensors in as they are touched; weights_only refuses pickled code.
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # pre-zip (torch < 1.6) files cannot be memory-mapped
        return torch.load(path, map_location="cpu", weights_only=True)


def iter_hf_tensors(directory: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(HF key, tensor)`` from an HF directory, one file open at a time (Mixtral experts stacked:
    ``hf_moe``)."""
    groups = expert_groups(_raw_shapes(directory))
    yield from canonical_tensors(_raw_tensors(directory), groups)


def _raw_tensors(directory: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    files = hf_weight_files(directory)
    if files[0].suffix == ".safetensors":
        yield from iter_safetensors(files)
        return
    for path in files:
        state = _load_bin(path)
        while state:
            key = next(iter(state))
            yield key, state.pop(key)
        del state


def hf_tensor_shapes(directory: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape in an HF directory (safetensors headers; ``.bin`` files are memory-mapped), as
    ``iter_hf_tensors`` yields them."""
    return canonical_shapes(_raw_shapes(directory))


def _raw_shapes(directory: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    files = hf_weight_files(directory)
    if files[0].suffix == ".safetensors":
        return safetensors_shapes(files)
    return {key: tuple(t.shape) for path in files for key, t in _load_bin(path).items()}


def read_projector_file(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A published projector file → ``{neva projector key: tensor}``.

    LLaVA's ``--pretrain_mm_mlp_adapter`` file (``mm_projector.bin``: a ``torch.save`` dict of
    ``model.mm_projector.{i}.weight|bias``, read with ``weights_only=True``), or a safetensors file under the same or
    llava-hf (``multi_modal_projector.linear_{n}``) names.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a key that is not a projector tensor (names it).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"projector weights {path}: no such file")
    state = dict(iter_safetensors([path])) if path.suffix == ".safetensors" else _load_bin(path)
    mapping = _map_keys(list(state), detect_prefixes(list(state), parts=("projector",)), path)
    return {mapping[k]: t for k, t in state.items() if k in mapping}


def load_hf_config(directory: str | os.PathLike) -> dict[str, Any]:
    """An HF ``config.json`` with transformers' defaults filled in (``AutoConfig(...).to_dict()``)."""
    from transformers import AutoConfig

    return from_local(AutoConfig, directory).to_dict()


def _image_processor_dict(directory: Path) -> dict[str, Any] | None:
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = directory / name
        if path.is_file():
            data = json.loads(path.read_text())
            data = data.get("image_processor", data)
            if "image_mean" in data:
                return data
    return None


def _with_image_stats(cfg: NevaConfig, directory: Path) -> NevaConfig:
    """Take ``image_mean``/``image_std`` from the directory's image processor config if it has one."""
    proc = _image_processor_dict(directory)
    if proc is None or cfg.vision is None:
        return cfg
    vision = dataclasses.replace(
        cfg.vision, image_mean=tuple(proc["image_mean"]), image_std=tuple(proc.get("image_std", cfg.vision.image_std))
    )
    return dataclasses.replace(cfg, vision=vision)


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in TOKENIZER_FILES)


def _map_keys(hf_keys: list[str], prefixes: dict[str, str], source: Path) -> dict[str, str]:
    """HF key → neva key for every key kept; unknown keys that are not knowingly dropped are an error."""
    mapping, unknown = {}, []
    for key in hf_keys:
        neva = hf_key_to_neva(key, prefixes)
        if neva is not None:
            mapping[key] = neva
        elif not _IGNORED.search(key):
            unknown.append(key)
    if unknown:
        raise ValueError(f"{source}: {len(unknown)} tensor(s) with no neva counterpart, e.g. {unknown[:5]}")
    return mapping


# The embedding and LM head rows an import adds for ``<image>``, ``<pad>`` and vocabulary padding.
_GROWN = ("llm.tok_embeddings.weight", TIED_HEAD_KEY)


def _check_complete(cfg: NevaConfig, produced: dict[str, tuple[int, ...]], source: str) -> None:
    """Every tensor of ``cfg``'s model is ``produced`` (neva key -> shape), with its shape, before anything is read."""
    expected = expected_shapes(cfg)
    missing = sorted(set(expected) - set(produced))
    if missing:
        raise ValueError(f"{source}: {len(missing)} model tensor(s) not found, e.g. {missing[:5]}")
    for key, shape in produced.items():
        if key in expected:
            check_shape(key, shape, expected[key], source, grows=key in _GROWN)


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


# ----------------------------------------------------------------------------------------------------- llava-hf in


def import_llava(
    hf_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    metadata: dict[str, Any] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Convert a llava-hf directory (current or legacy key layout, safetensors or ``.bin``) to a neva checkpoint.

    Args:
        hf_dir: directory with ``config.json`` (``LlavaConfig``), weights and, ideally, the tokenizer.
        out: neva checkpoint directory to create.
        dtype: cast floating tensors to this dtype; None keeps the stored dtypes.
        metadata: extra entries for the checkpoint's ``config.json``.
        max_shard_bytes: output shard size limit.
        overwrite: replace an existing ``out``.

    Returns:
        ``out``.

    Raises:
        ValueError: tensors that map nowhere or model tensors that are missing; an ``<image>`` token whose id differs
            from the config's ``image_token_index``.
    """
    hf_dir = Path(model_dir(hf_dir))
    cfg = _with_image_stats(neva_config_from_llava(load_hf_config(hf_dir)), hf_dir)
    shapes = hf_tensor_shapes(hf_dir)
    mapping = _map_keys(list(shapes), detect_prefixes(list(shapes)), hf_dir)
    _check_complete(cfg, {mapping[k]: shapes[k] for k in mapping}, str(hf_dir))
    tokenizer = None
    if _has_tokenizer(hf_dir):
        from transformers import AutoTokenizer

        tokenizer = from_local(AutoTokenizer, hf_dir)
        _check_image_token(tokenizer, cfg.image_token_id, hf_dir)
    meta = {"source": {"kind": "llava-hf", "path": str(hf_dir)}, **_template_metadata(hf_dir, tokenizer, metadata)}
    tensors = ((mapping[k], _cast(t, dtype)) for k, t in iter_hf_tensors(hf_dir) if k in mapping)
    return save_checkpoint(
        out, cfg, tensors, tokenizer, max_shard_bytes=max_shard_bytes, metadata=meta, overwrite=overwrite
    )


def _template_metadata(hf_dir: Path, tokenizer: Any, metadata: dict[str, Any] | None) -> dict[str, Any]:
    """The caller's metadata plus the template settings of a neva export (its chat template's mark).

    A built-in template's Jinja is dropped from the tokenizer: neva renders built-ins itself (BOS from the tokenizer),
    and a tokenizer chat template would take precedence for ``mistral``/``llama_3``/``chatml``.
    """
    metadata = dict(metadata or {})
    settings = read_template_settings(hf_dir)
    if settings is None:
        if "conv_template" not in metadata:
            warnings.warn(
                f"{hf_dir} has no chat template written by neva and no --conv-template was given: neva.generate will "
                "render prompts as vicuna_v1 (LLaVA-1.5's format); pass --conv-template if the model was trained "
                "with another",
                stacklevel=3,
            )
        return metadata
    if settings.get("builtin") and tokenizer is not None:
        tokenizer.chat_template = None
    if "conv_template" in metadata and metadata["conv_template"] != settings["conv_template"]:
        return metadata  # the caller's choice wins, the export's system prompt belongs to its template
    for key in ("conv_template", "system_prompt", "use_chat_template"):
        metadata.setdefault(key, settings.get(key))
    return metadata


def _check_image_token(tokenizer: Any, image_token_id: int, source: Path) -> None:
    found = tokenizer.get_vocab().get(IMAGE_TOKEN)
    if found is None:
        warnings.warn(f"{source}: tokenizer has no {IMAGE_TOKEN} token; prompts cannot place images", stacklevel=3)
    elif found != image_token_id:
        raise ValueError(f"{source}: tokenizer maps {IMAGE_TOKEN} to {found}, config says image token {image_token_id}")


# ------------------------------------------------------------------------------------------ Llama + CLIP in (new)


def _grow_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """Append rows equal to the mean of the existing ones (a neutral start for new tokens, as LLaVA does)."""
    if weight.shape[0] >= rows:
        return weight
    mean = weight.float().mean(dim=0, keepdim=True).to(weight.dtype)
    return torch.cat([weight, mean.expand(rows - weight.shape[0], -1)])


def prepare_tokenizer(llm_dir: str | os.PathLike) -> Any:
    """The HF tokenizer of ``llm_dir`` with ``<image>`` (and ``<pad>`` if it has no pad token) added as specials."""
    from transformers import AutoTokenizer

    tokenizer = from_local(AutoTokenizer, llm_dir)
    _add_vision_tokens(tokenizer)
    return tokenizer


@torch.no_grad()
def load_hf_weights(model: Any, llm_dir: str | os.PathLike, vision_dir: str | os.PathLike | None = None) -> None:
    """Copy an HF Llama's (and optionally an HF CLIP's) weights into a materialised neva model, tensor by tensor.

    The projector is left as it is (freshly initialised by the caller). Embedding / LM-head rows beyond the HF
    vocabulary (``<image>``, ``<pad>``, padding) are set to the mean of the HF rows.

    Args:
        model: a ``NevaModel`` (or any object with ``cfg`` and ``state_dict()`` under neva keys) on a real device.
        llm_dir: HF ``LlamaForCausalLM`` directory.
        vision_dir: HF CLIP or SigLIP directory (vision model or whole model), or None to keep the vision tower as is.

    Raises:
        ValueError: unknown HF tensors, LLM/vision tensors the directories lack, or a tensor whose shape is not the
            model's (an embedding may have fewer rows; names and shapes are checked before anything is copied).
    """
    targets = model.state_dict()
    sources = [(Path(model_dir(llm_dir)), "llm")]
    sources += [(Path(model_dir(vision_dir)), "vision")] if vision_dir is not None else []
    for directory, part in sources:
        shapes = hf_tensor_shapes(directory)
        mapping = _map_keys(list(shapes), detect_prefixes(list(shapes), parts=(part,)), directory)
        wanted = {k for k in targets if k.startswith(part + ".") and not k.endswith("inv_freq")}
        if part == "llm" and model.cfg.llm.tie_word_embeddings:
            wanted.discard(TIED_HEAD_KEY)
        missing = sorted(wanted - set(mapping.values()))
        if missing:
            raise ValueError(f"{directory}: {len(missing)} {part} tensor(s) not found, e.g. {missing[:5]}")
        for key, name in mapping.items():
            if name in targets:
                check_shape(name, shapes[key], targets[name].shape, directory, grows=name in _GROWN)
        for key, tensor in iter_hf_tensors(directory):
            name = mapping.get(key)
            if name is None or name not in targets:
                continue
            target = targets[name]
            if name in _GROWN:
                tensor = _grow_rows(tensor, target.shape[0])
            target.copy_(tensor)


def _add_vision_tokens(tokenizer: Any) -> None:
    """Add ``<image>`` as a special token, and ``<pad>`` if there is no pad token (llava-hf's order)."""
    if IMAGE_TOKEN not in tokenizer.get_vocab():
        # An extra special token: never split, and skipped by decode(skip_special_tokens=True).
        tokenizer.add_special_tokens({"extra_special_tokens": [IMAGE_TOKEN]}, replace_extra_special_tokens=False)
    if tokenizer.pad_token is None:
        tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})


def import_llm_and_vision(
    llm_dir: str | os.PathLike,
    vision_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    vision_select_layer: int | list[int] = -2,
    vision_select_feature: str = "patch",
    projector_type: str = "mlp2x_gelu",
    pad_vocab_multiple: int = 1,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    metadata: dict[str, Any] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Assemble a new neva checkpoint from an HF Llama and an HF CLIP or SigLIP (vision model or whole model).

    The projector is freshly initialised (seeded). ``<image>`` (and ``<pad>`` if missing) join the tokenizer as
    special tokens; the embedding and LM head grow to the new vocabulary, new rows set to the mean of the old ones.

    Args:
        llm_dir: HF ``LlamaForCausalLM`` directory with its tokenizer.
        vision_dir: HF ``CLIPVisionModel`` / ``CLIPModel`` / ``SiglipVisionModel`` / ``SiglipModel`` directory (the text
            tower, contrastive heads and SigLIP's pooling head are skipped).
        out: neva checkpoint directory to create.
        vision_select_layer: CLIP hidden state(s) fed to the projector (LLaVA ``mm_vision_select_layer``).
        vision_select_feature: ``patch`` (drop CLS) or ``cls_patch``.
        projector_type: ``linear``, ``identity`` or ``mlp{N}x_gelu``.
        pad_vocab_multiple: round the grown vocabulary up to a multiple of this (llava-hf used 64).
        seed: projector initialisation seed.
        dtype: cast everything to this dtype; None keeps the LLM's dtype for the projector and stored dtypes else.
        metadata: extra entries for the checkpoint's ``config.json``.
        max_shard_bytes: output shard size limit.
        overwrite: replace an existing ``out``.

    Returns:
        ``out``.
    """
    llm_dir, vision_dir = Path(model_dir(llm_dir)), Path(model_dir(vision_dir))
    llm = llm_config_from_hf(load_hf_config(llm_dir))
    vision = vision_config_from_hf(load_hf_config(vision_dir), vision_select_layer, vision_select_feature)
    tokenizer = prepare_tokenizer(llm_dir)
    vocab = max(llm.vocab_size, len(tokenizer))
    vocab = -(-vocab // pad_vocab_multiple) * pad_vocab_multiple
    projector = ProjectorConfig(type=projector_type, input_size=vision.feature_size, output_size=llm.hidden_size)
    cfg = NevaConfig(
        llm=dataclasses.replace(llm, vocab_size=vocab),
        vision=vision,
        projector=projector,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
    )
    cfg = _with_image_stats(cfg, vision_dir)

    vision_shapes, llm_shapes = hf_tensor_shapes(vision_dir), hf_tensor_shapes(llm_dir)
    vision_map = _map_keys(list(vision_shapes), detect_prefixes(list(vision_shapes), parts=("vision",)), vision_dir)
    llm_map = _map_keys(list(llm_shapes), detect_prefixes(list(llm_shapes), parts=("llm",)), llm_dir)
    produced = {f"projector.{k}": tuple(t.shape) for k, t in build_projector(projector).state_dict().items()}
    produced.update({vision_map[k]: vision_shapes[k] for k in vision_map})
    produced.update({llm_map[k]: llm_shapes[k] for k in llm_map})
    _check_complete(cfg, produced, f"{llm_dir} + {vision_dir}")

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for key, tensor in iter_hf_tensors(vision_dir):
            if key in vision_map:
                yield vision_map[key], _cast(tensor, dtype)
        llm_dtype = dtype
        for key, tensor in iter_hf_tensors(llm_dir):
            if key in llm_map:
                name = llm_map[key]
                if name in ("llm.tok_embeddings.weight", TIED_HEAD_KEY):
                    tensor = _grow_rows(tensor, vocab)
                llm_dtype = llm_dtype or tensor.dtype
                yield name, _cast(tensor, dtype)
        yield from _fresh_projector(projector, seed, llm_dtype)

    meta = {
        "source": {"kind": "llm+vision", "llm": str(llm_dir), "vision": str(vision_dir)},
        **(metadata or {}),
    }
    return save_checkpoint(
        out, cfg, tensors(), tokenizer, max_shard_bytes=max_shard_bytes, metadata=meta, overwrite=overwrite
    )


def _fresh_projector(cfg: ProjectorConfig, seed: int, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    with torch.random.fork_rng(devices=[]):  # seeded without disturbing the caller's RNG stream
        torch.manual_seed(seed)
        module = build_projector(cfg)
        init_projector(module)
    for key, tensor in module.state_dict().items():
        yield f"projector.{key}", _cast(tensor, dtype)


# ----------------------------------------------------------------------------------------------------- llava-hf out


def save_llava_hf(
    out: str | os.PathLike,
    cfg: NevaConfig,
    tensors: TensorSource,
    tokenizer: Any = None,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    template: dict[str, Any] | None = None,
) -> Path:
    """Write a llava-hf directory (current key layout) from neva tensors, streaming.

    Writes ``config.json`` (``LlavaConfig``), ``generation_config.json``, safetensors weights and, with a tokenizer,
    the tokenizer files plus a ``LlavaProcessor`` / ``CLIPImageProcessor`` config, so that
    ``LlavaForConditionalGeneration``, ``AutoTokenizer`` and ``AutoProcessor`` load the directory under transformers
    4.4x and 5.x (``hf_files``). With a tokenizer, the chat template renders as neva trained (``template`` settings,
    default ``vicuna_v1``) and ``generation_config.json`` stops at the template's end of turn. LoRA must be merged
    into ``tensors`` before (a plain neva state dict is expected).

    Args:
        out: directory to create.
        cfg: model config (needs a vision tower and an ``mlp2x_gelu`` projector).
        tensors: neva state dict or ``(key, tensor)`` iterator.
        tokenizer: HF tokenizer (or None: weights and configs only).
        dtype: cast floating tensors to this dtype; None keeps them.
        max_shard_bytes: shard size limit.
        overwrite: replace an existing ``out``.
        template: ``hf_files.template_settings`` of the checkpoint (None: ``vicuna_v1``, its default system prompt).

    Returns:
        ``out``.
    """
    from transformers import GenerationConfig

    template = template or template_settings({})
    config_class, architecture, _ = hf_classes(cfg)

    pad_id = getattr(tokenizer, "pad_token_id", None)
    config_kw = llava_config_dict(cfg, pad_token_id=pad_id)
    if tokenizer is not None:
        config_kw["text_config"].update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    with atomic_directory(out, overwrite) as tmp:
        dtypes: set[torch.dtype] = set()

        def hf_tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for key, tensor in tensor_pairs(tensors):
                if key == TIED_HEAD_KEY and cfg.llm.tie_word_embeddings:
                    continue
                tensor = _cast(tensor, dtype)
                if tensor.is_floating_point():
                    dtypes.add(tensor.dtype)
                yield from per_expert_tensors(neva_key_to_hf(key), tensor)

        write_safetensors(tmp, hf_tensors(), max_shard_bytes)
        config = config_class(**config_kw)
        config.architectures = [architecture]
        if len(dtypes) == 1:
            config.dtype = next(iter(dtypes))
        config.save_pretrained(str(tmp))
        text = config_kw["text_config"]
        eos = text.get("eos_token_id") if tokenizer is None else generation_eos_ids(template, tokenizer)
        GenerationConfig(bos_token_id=text.get("bos_token_id"), eos_token_id=eos, pad_token_id=pad_id).save_pretrained(
            str(tmp)
        )
        if tokenizer is not None:
            chat_template = export_chat_template(template, tokenizer)
            _save_processor(tmp, cfg, tokenizer, chat_template)
            write_chat_template_files(tmp, chat_template)
        make_transformers_4_readable(tmp, cfg, config.dtype if len(dtypes) == 1 else None)
    return Path(out)


def _with_image_row(
    cfg: NevaConfig, tensors: Iterator[tuple[str, torch.Tensor]]
) -> tuple[NevaConfig, Iterator[tuple[str, torch.Tensor]]]:
    """``cfg`` and ``tensors`` with one more vocabulary row, the image token's, set to the mean of the others."""
    grown = dataclasses.replace(cfg, llm=dataclasses.replace(cfg.llm, vocab_size=cfg.llm.vocab_size + 1))
    rows = grown.llm.vocab_size
    return grown, ((k, _grow_rows(t, rows) if k in _GROWN else t) for k, t in tensors)


def _save_processor(directory: Path, cfg: NevaConfig, tokenizer: Any, chat_template: str) -> None:
    import copy

    tokenizer = copy.copy(tokenizer)  # the caller's tokenizer keeps its own chat template
    tokenizer.chat_template = chat_template

    v = cfg.vision
    image_processor = hf_image_processor(v, cfg.anyres)
    fields = dict(
        patch_size=v.patch_size,
        vision_feature_select_strategy=hf_select_strategy(v),
        num_additional_image_tokens=v.class_tokens,  # CLIP's CLS ("default" removes it again); SigLIP has none
        image_token=tokenizer.convert_ids_to_tokens(cfg.image_token_id),
    )
    if cfg.video is not None:
        save_video_processor(directory, cfg, tokenizer, image_processor, fields)
        return
    if cfg.anyres is not None and cfg.anyres.max_num_patches is not None:
        save_onevision_processor(directory, cfg, tokenizer, image_processor, fields)
        return
    processor = hf_classes(cfg)[2](
        image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template, **fields
    )
    processor.save_pretrained(str(directory))
    # transformers 4.x reads the image processor from its own file; 5.x from processor_config.json.
    image_processor.save_pretrained(str(directory))


def hf_classes(cfg: NevaConfig) -> tuple[type, str, type]:
    """``(config class, architecture, processor class)`` of the llava-hf export: LLaVA-NeXT's with AnyRes,
    LLaVA-OneVision's when it pools (``anyres_max_N``)."""
    import transformers as tf

    if cfg.video is not None:
        return tf.LlavaNextVideoConfig, "LlavaNextVideoForConditionalGeneration", tf.LlavaNextVideoProcessor
    if cfg.anyres is not None and cfg.anyres.max_num_patches is not None:
        return tf.LlavaOnevisionConfig, "LlavaOnevisionForConditionalGeneration", tf.LlavaOnevisionProcessor
    if cfg.anyres is not None:
        return tf.LlavaNextConfig, "LlavaNextForConditionalGeneration", tf.LlavaNextProcessor
    return tf.LlavaConfig, "LlavaForConditionalGeneration", tf.LlavaProcessor


def hf_image_processor(v: Any, anyres: Any = None) -> Any:
    """The transformers image processor doing what neva's does for tower ``v`` (``square`` aspect ratio): CLIP
    resizes the short side and centre-crops, SigLIP resizes to the square (``neva.data.images``). With AnyRes,
    ``LlavaNextImageProcessor`` (its PIL backend where torchvision is absent) over the model's pinpoints, its
    per-tile resize and crop no-ops on tiles of the tower's size, as ``neva.data.anyres`` tiles (for both towers)."""
    from transformers import CLIPImageProcessor, SiglipImageProcessor

    stats = dict(image_mean=list(v.image_mean), image_std=list(v.image_std))
    if anyres is not None and anyres.max_num_patches is not None:
        from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
            LlavaOnevisionImageProcessorPil,
        )

        return LlavaOnevisionImageProcessorPil(
            size={"height": v.image_size, "width": v.image_size},
            image_grid_pinpoints=[list(p) for p in anyres.grid_pinpoints],
            **stats,
        )
    if anyres is not None:
        from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

        return LlavaNextImageProcessorPil(
            size={"shortest_edge": v.image_size},
            crop_size={"height": v.image_size, "width": v.image_size},
            image_grid_pinpoints=[list(p) for p in anyres.grid_pinpoints],
            **stats,
        )
    if v.kind == "siglip":
        return SiglipImageProcessor(size={"height": v.image_size, "width": v.image_size}, **stats)
    return CLIPImageProcessor(
        size={"shortest_edge": v.image_size}, crop_size={"height": v.image_size, "width": v.image_size}, **stats
    )


def export_llava(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    conv_template: str | None = None,
) -> Path:
    """Convert a neva checkpoint directory to a llava-hf directory (see ``save_llava_hf``).

    ``dtype`` None exports in the run's half precision (``trainer.precision`` bf16 → bfloat16), else keeps the stored
    dtypes. The chat template is the one the checkpoint records (``conv_template``, ``system_prompt``,
    ``use_chat_template``), ``conv_template`` overriding the name; a checkpoint that records none exports ``vicuna_v1``
    (what ``neva.generate`` uses for it) with a warning.
    """
    ckpt = Path(ckpt)
    cfg = load_config(ckpt)
    meta = load_metadata(ckpt)
    tokenizer = None
    if _has_tokenizer(ckpt):
        from transformers import AutoTokenizer

        tokenizer = from_local(AutoTokenizer, ckpt)
    aspect = meta.get("image_aspect_ratio", "square")
    if aspect not in ("square", "anyres") and parse_aspect_ratio(aspect) is None:  # AnyRes: tiled as the run did
        warnings.warn(
            f"checkpoint uses image_aspect_ratio={aspect!r}; the exported "
            f"{type(hf_image_processor(cfg.vision)).__name__} does not pad as the run did",
            stacklevel=2,
        )
    if meta.get("tokenization", "neva") == "llava":
        warnings.warn(
            f"{ckpt} was trained with model.data.tokenization=llava (LLaVA's tokenizer_image_token ids); transformers' "
            "LlavaProcessor tokenizes the whole prompt once, so served prompts lack the dummy-prefix token after each "
            "image (docs/INTEROP.md); neva.generate serves this checkpoint with its trained ids",
            stacklevel=2,
        )
    template = template_settings(meta, conv_template)
    if tokenizer is not None and not (conv_template or meta.get("conv_template")):
        warnings.warn(
            f"{ckpt} records no conv_template; the export's chat template is {template['conv_template']} (what "
            "neva.generate uses for this checkpoint); pass --conv-template to choose another",
            stacklevel=2,
        )
    tensors: Iterator[tuple[str, torch.Tensor]] = iter_tensors(ckpt)
    if not cfg.image_token_has_row:
        # LLaVA-original imports have no <image> row (LLaVA splices at -200); llava-hf embeds image_token_index, so
        # the export appends one mean row (an extra class in the served softmax: docs/INTEROP.md).
        cfg, tensors = _with_image_row(cfg, tensors)
    return save_llava_hf(
        out,
        cfg,
        tensors,
        tokenizer,
        dtype=dtype if dtype is not None else export_dtype(meta),
        max_shard_bytes=max_shard_bytes,
        overwrite=overwrite,
        template=template,
    )
