"""A tiny checkpoint in LLaVA's own layout (haotian-liu/LLaVA ``llava_llama``), written by hand so that LLaVA's
trainer (transformers 4.36) and neva (transformers 5) both read it: ``config.json`` with the ``mm_*`` keys,
``model.*`` / ``lm_head`` / ``model.mm_projector.*`` weights, a sentencepiece tokenizer, and the CLIP tower directory
that ``mm_vision_tower`` names. Every tower weight is an fp16 value, so LLaVA's ``train.py``, which casts the tower to
fp16 in non-bf16 runs, loses nothing when the test casts it back to fp32."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch
from PIL import Image
from safetensors.torch import save_file
from torch import nn
from transformers import CLIPVisionConfig, CLIPVisionModel, LlamaConfig, LlamaForCausalLM

from tests.checkpoint.tiny_hf import LINES, SP_VOCAB
from tests.hf_oracle import VISION_KW

# LLaVA-1.5's shape of things at toy size: Llama 64 wide, 3 layers; CLIP 28 px, patch 7 (16 image tokens).
TEXT = dict(vocab_size=SP_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0)  # fmt: skip
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
MM = {
    "mm_hidden_size": VISION_KW["hidden_size"],
    "mm_projector_type": "mlp2x_gelu",
    "mm_vision_select_layer": -2,
    "mm_vision_select_feature": "patch",
    "mm_patch_merge_type": "flat",
    "mm_use_im_start_end": False,
    "mm_use_im_patch_token": False,
    "mm_projector_lr": None,
    "image_aspect_ratio": "pad",
    "tokenizer_padding_side": "right",
    "tokenizer_model_max_length": 2048,
    "tune_mm_mlp_adapter": False,
    "freeze_mm_mlp_adapter": False,
    "use_mm_proj": True,
}


def make_tower(directory: Path, seed: int = 2) -> Path:
    """A CLIPVisionModel directory with fp16-exact weights and the CLIPImageProcessor config LLaVA loads."""
    torch.manual_seed(seed)
    model = CLIPVisionModel(CLIPVisionConfig(**VISION_KW)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            p.copy_(p.half().float())
    return save_tower(directory, model)


def save_tower(directory: Path, model: nn.Module) -> Path:
    """A CLIPVisionModel's directory as the Hub has it, with LLaVA's CLIPImageProcessor config."""
    model.save_pretrained(str(directory))
    # The Hub's CLIP layout (openai/clip-vit-*: ``vision_model.*``), which transformers 4.x loads; 5.x saves the keys
    # of a CLIPVisionModel without the prefix, and 4.x would initialise such a tower afresh.
    state = {f"vision_model.{k}": v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    size = model.config.image_size
    processor = {"image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": size},
                 "resample": 3, "do_center_crop": True, "crop_size": {"height": size, "width": size},
                 "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": CLIP_MEAN,
                 "image_std": CLIP_STD, "do_convert_rgb": True}  # fmt: skip
    (directory / "preprocessor_config.json").write_text(json.dumps(processor, indent=1))
    return directory


def write_tokenizer(directory: Path, user_pieces: tuple[str, ...] = ()) -> None:
    """Vicuna's tokenizer files at toy size: a sentencepiece BPE model normalised as Llama's is (identity rules, a
    dummy prefix, whitespace kept), no pad token (LLaVA pads with ``<unk>``); ``user_pieces``: sentencepiece
    user-defined pieces (whole before any merge, as many non-Llama tokenizers have them)."""
    directory.mkdir(parents=True, exist_ok=True)
    prefix = directory.with_name(directory.name + "_sp")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(LINES * 10), model_prefix=str(prefix), vocab_size=SP_VOCAB, model_type="bpe",
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, byte_fallback=True, character_coverage=1.0,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True,
        allow_whitespace_only_pieces=True, minloglevel=2, user_defined_symbols=list(user_pieces),
    )  # fmt: skip
    (directory / "tokenizer.model").write_bytes(prefix.with_suffix(".model").read_bytes())
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False, "legacy": False,
              "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None,
              "model_max_length": 2048, "clean_up_tokenization_spaces": False, "sp_model_kwargs": {}}  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (directory / "special_tokens_map.json").write_text(json.dumps(specials))


def llava_config(tower: Path, **mm) -> dict:
    return {"architectures": ["LlavaLlamaForCausalLM"], "model_type": "llava_llama", **TEXT, "hidden_act": "silu",
            "rope_scaling": None, "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 1,
            "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float32", "use_cache": False,
            "initializer_range": 0.02, "pretraining_tp": 1, **MM, "mm_vision_tower": str(tower), **mm}  # fmt: skip


def make_llava_original(
    directory: Path, tower: Path, seed: int = 4, pretrain_only: bool = False, user_pieces: tuple[str, ...] = ()
) -> dict:
    """A LLaVA checkpoint (decoder + ``model.mm_projector.*``), or with ``pretrain_only`` what LLaVA's pretrain stage
    saves (``config.json`` + ``mm_projector.bin``) and, beside it in ``<directory>_llm``, the plain HF Llama it
    started from; returns the state dict written (projector included)."""
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    llm = LlamaForCausalLM(LlamaConfig(**TEXT))
    with torch.no_grad():
        for name, p in llm.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hidden = TEXT["hidden_size"]
    projector = nn.Sequential(nn.Linear(VISION_KW["hidden_size"], hidden), nn.GELU(), nn.Linear(hidden, hidden))
    proj = {f"model.mm_projector.{k}": v.detach().clone() for k, v in projector.state_dict().items()}
    state = {k: v.detach().clone().contiguous() for k, v in llm.state_dict().items() if "rotary" not in k}
    (directory / "config.json").write_text(json.dumps(llava_config(tower), indent=1))
    if pretrain_only:
        torch.save(proj, directory / "mm_projector.bin")
        base = directory.with_name(directory.name + "_llm")
        base.mkdir()
        save_file(state, str(base / "model.safetensors"), metadata={"format": "pt"})
        plain = {k: v for k, v in llava_config(tower).items() if k not in MM and k != "mm_vision_tower"}
        (base / "config.json").write_text(json.dumps({**plain, "model_type": "llama",
                                                      "architectures": ["LlamaForCausalLM"]}))  # fmt: skip
        write_tokenizer(base, user_pieces)
    else:
        save_file({**state, **proj}, str(directory / "model.safetensors"), metadata={"format": "pt"})
        write_tokenizer(directory, user_pieces)
    return {**state, **proj}


def save_image(path: Path, seed: int, size: tuple[int, int]) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path.name


def make_records(folder: Path) -> list[dict]:
    """Eight LLaVA records: three multi-turn, one text-only, non-square images of two sizes, tags front and back."""
    folder.mkdir(parents=True, exist_ok=True)
    wide = [save_image(folder / f"wide{i}.png", i, (40, 30)) for i in range(4)]
    tall = [save_image(folder / f"tall{i}.png", 10 + i, (24, 36)) for i in range(3)]

    def conv(*turns: str) -> list[dict]:
        return [{"from": "human" if i % 2 == 0 else "gpt", "value": t} for i, t in enumerate(turns)]

    return [
        {"id": "0", "image": wide[0], "conversations": conv("<image>\nWhat is in the image?", "A red ball.")},
        {"id": "1", "image": tall[0], "conversations": conv("Describe it in detail.\n<image>",
                                                            "A cat sits on the mat next to a red ball.")},
        {"id": "2", "image": wide[1], "conversations": conv("<image>\nWhat is it?", "A fox.", "Is it quick?",
                                                            "The quick brown fox jumps over the lazy dog.")},
        {"id": "3", "conversations": conv("hello world, what is a tokenizer?", "A tiny tokenizer for tests.")},
        {"id": "4", "image": tall[1], "conversations": conv("<image>\nWhat is in the image?", "A blue circle.",
                                                            "And next to it?", "A red square.", "Colour of the mat?",
                                                            "Red.")},
        {"id": "5", "image": wide[2], "conversations": conv("What is in the image? <image>", "A lazy dog.")},
        {"id": "6", "image": tall[2], "conversations": conv("<image>\nDescribe it.", "A picture of a red square.",
                                                            "What else?", "A blue circle and a cat.")},
        {"id": "7", "image": wide[3], "conversations": conv("<image>\nWhat is it?", "The mat.")},
    ]  # fmt: skip
