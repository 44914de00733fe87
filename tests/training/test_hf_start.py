"""Real-run wiring on tiny HF checkpoints: pretrain from HF Llama + CLIP dirs, then LoRA finetune, merged export."""

import torch
from safetensors.torch import load_file
from transformers import AutoProcessor

from neva.checkpoint.hf_export import export_llava
from neva.checkpoint.neva_format import iter_tensors, load_config
from neva.config import compose_config
from neva.data.templates.base import Message
from neva.data.templates.registry import get_template
from neva.training.run import run
from tests.checkpoint.tiny_hf import make_clip_dir, make_llama_dir, one_thread

QUIET = [
    "exp_manager.create_tensorboard_logger=false",
    "trainer.enable_progress_bar=false",
    "trainer.val_check_interval=1000",
    "trainer.max_steps=2",
    "model.micro_batch_size=2",
    "model.global_batch_size=4",
    "model.data.synthetic_train_samples=16",
    "model.data.synthetic_val_samples=4",
]


def test_pretrain_from_hf_then_lora_finetune(tmp_path):
    llama, _ = make_llama_dir(tmp_path / "llama")
    make_clip_dir(tmp_path / "clip")
    with one_thread():
        pretrain = compose_config([
            "+stage=pretrain", *QUIET, f"exp_manager.exp_dir={tmp_path}/pretrain",
            f"model.mm_cfg.llm.from_pretrained={tmp_path}/llama",
            f"model.mm_cfg.vision_encoder.from_pretrained={tmp_path}/clip",
        ])  # fmt: skip
        first = run(pretrain)
    cfg = load_config(first)
    assert cfg.vision.image_size == 28 and cfg.llm.hidden_size == llama.config.hidden_size
    weights = dict(iter_tensors(first))
    hf = llama.state_dict()
    # The LLM was frozen: its weights are HF's (the two added token rows aside).
    assert torch.equal(weights["llm.layers.0.attention.wq.weight"], hf["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(weights["llm.tok_embeddings.weight"][: hf["model.embed_tokens.weight"].shape[0]],
                       hf["model.embed_tokens.weight"])  # fmt: skip

    with one_thread():
        finetune = compose_config([
            "+stage=finetune", *QUIET, f"exp_manager.exp_dir={tmp_path}/finetune",
            f"model.restore_from_path={first}", "model.peft.peft_scheme=lora", "model.optim.lr=1e-2",
            "model.data.system_prompt=Brief",
        ])  # fmt: skip
        second = run(finetune)
    merged = {}
    for f in sorted(second.glob("*.safetensors")):
        merged.update(load_file(f))
    assert not [k for k in merged if "lora" in k or ".base." in k]
    assert set(merged) == set(weights)
    delta = (merged["llm.layers.0.attention.wq.weight"] - weights["llm.layers.0.attention.wq.weight"]).abs().max()
    assert delta > 0  # the adapters were trained and folded in
    assert torch.equal(merged["vision.patch_embed.weight"], weights["vision.patch_embed.weight"])

    # served as trained: the export's chat template renders the run's template with the run's system prompt
    template = finetune.model.data.conv_template
    out = export_llava(second, tmp_path / "hf")
    prompt = AutoProcessor.from_pretrained(out).apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}], add_generation_prompt=True
    )
    assert prompt == get_template(template).render_prompt([Message("user", "<image>\nHi")], system_prompt="Brief")
