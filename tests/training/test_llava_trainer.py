"""Done-means of LLaVA fidelity: neva finetunes a LLaVA checkpoint as LLaVA's own trainer does.

LLaVA's ``llava/train/train.py`` (the ``llava-torch==1.2.2.post1`` wheel, HF Trainer underneath; ``train.py``, not
``train_mem.py``: no flash-attn, no DeepSpeed) runs in its own environment (transformers 4.36.2, built once and
cached, ``tests/pip_site.py``) on a tiny LLaVA-original checkpoint (CLIP 28 px, Llama 64 wide, 3 layers) and eight
records (three multi-turn, one text-only, non-square images of two sizes): one global batch of 8, fp32 on CPU, four
steps, LLaVA-1.5's finetune settings. neva converts the same directory (``neva.convert hf-to-neva``) and trains with
the LLaVA preset's keys. The tokenizer has sentencepiece user-defined pieces (the template's ``USER`` /
``ASSISTANT``, ``▁assistant``, ``▁image``), which neva reads as LLaVA's slow tokenizer does (``neva.data.sentencepiece_tokenizer``). Per step the losses agree to 1e-4 relative and the learning rates are equal; the input ids
and labels of every sample are LLaVA's.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from neva.checkpoint.neva_format import load_config, load_tokenizer
from neva.constants import IGNORE_INDEX
from neva.data.dataset import EncoderSettings, encode_record
from neva.data.templates.registry import get_template
from tests.checkpoint.tiny_llava_original import make_llava_original, make_records, make_tower
from tests.parallel.harness import run_module
from tests.pip_site import cached_site

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
LLAVA_PINS = ("llava-torch==1.2.2.post1", "transformers==4.36.2", "tokenizers==0.15.0", "accelerate==0.21.0",
              "sentencepiece==0.1.99", "numpy<2", "huggingface_hub==0.26.5", "peft==0.6.2", "requests", "urllib3",
              "idna", "certifi", "charset_normalizer")  # fmt: skip
# peft: transformers' Trainer imports peft when it is importable, and the test venv's peft needs a newer accelerate.
STEPS = 4
# sentencepiece user-defined pieces, whole before any merge: the v1 template's role names and two words of its system
# prompt and records with their word boundary. transformers 5's own conversion of this tokenizer.model splits
# `` assistant`` into ``▁a s s i s t a n t`` (and a ``▁USER`` piece into ``▁ <0x55> <0x53> <0x45> <0x52>``); neva reads
# them as LLaVA's transformers 4.36 does. (``▁USER`` itself is not used here: LLaVA's preprocess_v1 then counts a
# round's tokens apart from the whole string, where ``</s>USER`` has no ``▁``, and drops multi-turn samples as a
# "tokenization mismatch"; neva keeps them, docs/DATA.md.)
USER_PIECES = ("USER", "ASSISTANT", "▁assistant", "▁image")
LLAVA_IMAGE = -200  # LLaVA's IMAGE_TOKEN_INDEX
# LLaVA-1.5 finetune (scripts/v1_5/finetune.sh) at toy size, lr 1e-3; what neva reads with the same meaning below.
LLAVA_ARGS = ["--version", "v1", "--mm_projector_type", "mlp2x_gelu", "--mm_vision_select_layer", "-2",
              "--mm_use_im_start_end", "False", "--mm_use_im_patch_token", "False", "--image_aspect_ratio", "pad",
              "--group_by_modality_length", "True", "--per_device_train_batch_size", "8",
              "--gradient_accumulation_steps", "1", "--max_steps", str(STEPS), "--learning_rate", "1e-3",
              "--weight_decay", "0.", "--warmup_ratio", "0.03", "--lr_scheduler_type", "cosine", "--adam_beta1", "0.9",
              "--adam_beta2", "0.999", "--adam_epsilon", "1e-8", "--max_grad_norm", "1.0", "--model_max_length",
              "2048", "--lazy_preprocess", "True", "--bf16", "False", "--fp16", "False", "--use_cpu", "True",
              "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none", "--dataloader_num_workers",
              "0", "--disable_tqdm", "True", "--seed", "0"]  # fmt: skip
NEVA_ARGS = ["model.data.conv_template=vicuna_v1", "model.data.image_aspect_ratio=pad",
             "model.data.tokenization=llava", "model.data.group_by_modality_length=true",
             "model.micro_batch_size=8", "model.global_batch_size=8", f"trainer.max_steps={STEPS}",
             "model.optim.lr=1e-3", "model.optim.weight_decay=0.0", "model.optim.betas=[0.9,0.999]",
             "model.optim.eps=1e-8", "model.optim.sched.warmup_ratio=0.03", "model.optim.sched.min_lr=0.0",
             "model.optim.sched.formula=hf",
             "model.loss_normalization=micro_batch_mean", "trainer.gradient_clip_val=1.0", "trainer.precision=32",
             "model.data.num_workers=0", "model.data.pad_to_multiple_of=1",
             "trainer.log_every_n_steps=1", "exp_manager.create_tensorboard_logger=false",
             "trainer.enable_progress_bar=false"]  # fmt: skip

# Runs LLaVA's train() as its command line would, with two additions made from outside: train.py casts the tower to
# fp16 in a non-bf16 run (``vision_tower.to(dtype=torch.bfloat16 if bf16 else torch.float16)``), which the trainer's
# constructor undoes (the test's tower weights are fp16 values: the round trip is exact, the run fp32 throughout);
# and each step's loss, learning rate and learned tokens, and the dataset's ids and labels, are written out.
DRIVER = r"""
import json, sys
import torch
torch.set_num_threads(1)
import llava.train.train as llava_train
out, argv = sys.argv[1], sys.argv[2:]
steps, samples = [], []

class Trainer(llava_train.LLaVATrainer):
    def __init__(self, model, **kwargs):
        model.get_vision_tower().to(torch.float32)
        super().__init__(model=model, **kwargs)
        data = kwargs["train_dataset"]
        samples.extend({k: data[i][k].tolist() for k in ("input_ids", "labels")} for i in range(len(data)))

    def training_step(self, model, inputs):
        lr = self.optimizer.param_groups[0]["lr"]
        loss = super().training_step(model, inputs)
        steps.append({"loss": float(loss), "lr": lr, "tokens": int((inputs["labels"][:, 1:] != -100).sum())})
        return loss

llava_train.LLaVATrainer = Trainer
# The checkpoint loads whole (transformers 4.x initialises missing weights with a warning only).
from transformers import CLIPVisionModel
from llava.model import LlavaLlamaForCausalLM
for cls, path in ((CLIPVisionModel, argv[argv.index("--vision_tower") + 1]),
                  (LlavaLlamaForCausalLM, argv[argv.index("--model_name_or_path") + 1])):
    _, info = cls.from_pretrained(path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (path, info)
sys.argv = ["train.py", *argv]
llava_train.train()
json.dump({"steps": steps, "samples": samples}, open(out, "w"))
"""


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONIOENCODING": "utf-8", **extra}


def run(cmd: list[str], **extra: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=env(**extra), capture_output=True, text=True, encoding="utf-8")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava_trainer")
    tower = make_tower(root / "clip")
    make_llava_original(root / "llava", tower, user_pieces=USER_PIECES)
    records = make_records(root / "images")
    (root / "data.json").write_text(json.dumps(records))
    return root, records


@pytest.fixture(scope="module")
def llava_run(case):
    root, _ = case
    site = cached_site("llava-torch-1.2.2.post1", LLAVA_PINS)
    args = ["--model_name_or_path", str(root / "llava"), "--vision_tower", str(root / "clip"), "--data_path",
            str(root / "data.json"), "--image_folder", str(root / "images"), "--output_dir", str(root / "llava_out"),
            *LLAVA_ARGS]  # fmt: skip
    run([sys.executable, "-c", DRIVER, str(root / "llava.json"), *args], PYTHONPATH=str(site))
    return json.loads((root / "llava.json").read_text())


@pytest.fixture(scope="module")
def neva_run(case):
    root, _ = case
    # neva's commands forked from the session's server (no interpreter start-up), as `python -m` runs them
    for module, argv in (
        ("neva.convert", ["hf-to-neva", "--hf", str(root / "llava"), "--conv-template", "vicuna_v1",
                          "--out", str(root / "ckpt")]),
        ("neva.train", ["+stage=finetune", f"model.restore_from_path={root / 'ckpt'}",
                        f"model.data.data_path={root / 'data.json'}", f"model.data.image_folder={root / 'images'}",
                        f"exp_manager.exp_dir={root / 'neva_out'}", *NEVA_ARGS]),
    ):  # fmt: skip
        proc = run_module(module, argv, env=env(), cwd=REPO)
        assert proc.returncode == 0, proc.stderr[-4000:]
    with open(next((root / "neva_out").rglob("metrics.csv"))) as f:
        rows = {int(r["step"]): r for r in csv.DictReader(f) if r.get("train_loss")}
    return root, [rows[s] for s in sorted(rows)]


def collapse(ids: list[int], labels: list[int], image_id: int) -> tuple[list[int], list[int]]:
    """neva's expanded image positions as LLaVA's one ``-200`` per image."""
    out_ids, out_labels = [], []
    for i, (tid, label) in enumerate(zip(ids, labels)):
        if tid == image_id:
            if i and ids[i - 1] == image_id:
                continue
            tid = LLAVA_IMAGE
        out_ids.append(tid)
        out_labels.append(label)
    return out_ids, out_labels


def test_neva_encodes_every_sample_as_llava_trainer(case, llava_run, neva_run):
    root, records = case
    ckpt = root / "ckpt"
    cfg, tokenizer = load_config(ckpt), load_tokenizer(ckpt)
    assert cfg.image_token_id == cfg.llm.vocab_size  # no <image> row: LLaVA's vocabulary, LLaVA's softmax
    settings = EncoderSettings(tokenizer, get_template("vicuna_v1", tokenizer), cfg.image_token_id,
                               cfg.num_image_tokens, None, tokenization="llava")  # fmt: skip
    for record, theirs in zip(records, llava_run["samples"]):
        enc, _ = encode_record(record, settings)
        ids, labels = collapse(enc.input_ids, enc.labels, cfg.image_token_id)
        assert ids == theirs["input_ids"], record["id"]
        assert labels == theirs["labels"], record["id"]
        assert any(label != IGNORE_INDEX for label in labels)  # LLaVA did not mask the sample as a mismatch
        assert tokenizer.convert_tokens_to_ids("▁assistant") in ids  # a user-defined piece, whole


def test_per_step_loss_and_lr_equal_llava_trainer(llava_run, neva_run):
    _, rows = neva_run
    theirs = llava_run["steps"]
    assert len(rows) == len(theirs) == STEPS
    for step, (ours, ref) in enumerate(zip(rows, theirs), start=1):
        assert int(float(ours["learned_tokens"])) == ref["tokens"], step
        assert float(ours["lr"]) == pytest.approx(ref["lr"], rel=1e-12, abs=0), step
        assert float(ours["train_loss"]) == pytest.approx(ref["loss"], rel=1e-4), step
    assert theirs[0]["lr"] == 0.0  # HF's warmup: lr 0 at the first step (so step 2 repeats step 1's loss)
    print("\nstep  llava_loss  neva_loss  rel_diff  lr")
    for step, (ours, ref) in enumerate(zip(rows, theirs), start=1):
        rel = abs(float(ours["train_loss"]) - ref["loss"]) / ref["loss"]
        print(f"{step}  {ref['loss']:.6f}  {float(ours['train_loss']):.6f}  {rel:.2e}  {ref['lr']:.6g}")
