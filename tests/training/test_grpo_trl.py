"""One GRPO update's loss and gradients equal TRL's ``GRPOTrainer._compute_loss`` on the same rollouts (prompts with an
image, completions, advantages, recorded old and reference log-probs) and the same tiny LLaVA (fp32, CPU), for each
loss type TRL shares with neva and with / without the KL term. TRL runs in a side environment (``trl`` and its data
dependencies installed beside the test venv's torch and transformers, ``tests/pip_site.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from neva.checkpoint.hf_keys import detect_prefixes, hf_key_to_neva
from neva.config import GRPOConfig
from neva.constants import IGNORE_INDEX
from neva.data.micro_batch import MicroBatch, RolloutRows
from neva.models.grpo_loss import group_advantages
from neva.models.media import Media, MediaInputs
from neva.parallel.layout import Layout
from neva.parallel.parallelize import ParallelModel
from neva.parallel.precision import Precision
from neva.training.engine import Engine
from neva.training.grpo import GroupPolicyObjective, record_old_logps, token_forward
from tests.hf_oracle import neva_from_hf, tiny_llava
from tests.pip_site import cached_site

REPO = Path(__file__).resolve().parents[2]
TRL_PINS = (
    "trl==1.16.0", "datasets==5.2.0", "pandas==3.1.1", "pyarrow==26.0.1", "dill==0.4.1", "multiprocess==0.70.19",
    "xxhash==4.1.0", "requests==2.34.2", "urllib3==2.8.0", "certifi==2026.10.19.post1", "charset-normalizer==3.5.3",
    "idna==3.21", "python-dateutil==4.0.0", "six==1.17.0", "tzdata==2026.6", "httpx==0.29.0", "httpcore==1.0.9",
    "anyio==4.16.0", "h11==0.16.0", "sniffio==1.3.1",
)  # fmt: skip
PROMPTS, G, MAX_NEW, PROMPT_TEXT = 2, 3, 5, 4
REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.2, 1.0])
CASES = [("grpo", 0.0, False), ("grpo", 0.05, False), ("dapo", 0.05, True), ("dr_grpo", 0.05, False)]

# Runs in the side environment: TRL's own trainer on the tiny LLaVA, its loss on the given inputs, loss and gradients
# saved by parameter name.
DRIVER = r"""
import sys, torch
from datasets import Dataset
from datasets.table import InMemoryTable  # a given fingerprint: datasets 5.2 cannot hash its own default one here
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer
from tests.hf_oracle import tiny_llava

case_path, out_path = sys.argv[1], sys.argv[2]
case = torch.load(case_path)
hf = tiny_llava(seed=0)
vocab = hf.config.text_config.vocab_size
tokenizer = PreTrainedTokenizerFast(
    tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0")),
    pad_token="t0", eos_token="t2",
)
results = {}
for loss_type, beta, correction in case["cases"]:
    args = GRPOConfig(
        output_dir=case["out_dir"], per_device_train_batch_size=case["rows"], num_generations=case["group"],
        max_completion_length=case["max_new"], loss_type=loss_type, beta=0.0, epsilon=0.2, epsilon_high=0.28,
        num_iterations=2, use_bias_correction_kl=correction, report_to=[], use_cpu=True, bf16=False, fp16=False, logging_steps=1,
    )
    trainer = GRPOTrainer(model=hf, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=args,
                          train_dataset=Dataset(InMemoryTable.from_pydict({"prompt": ["t1"] * case["rows"]}), fingerprint="grpo-test"), processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1
    trainer.beta = beta  # after __init__, which would load a reference model; its log-probs are given here
    model = trainer.model
    model.train()
    model.zero_grad(set_to_none=True)
    inputs = {k: case[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
                                   "old_per_token_logps", "pixel_values")}
    inputs["num_items_in_batch"] = case["completion_mask"].sum()
    inputs["num_images"] = [1] * case["rows"]
    if beta:
        inputs["ref_per_token_logps"] = case["ref_per_token_logps"]
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    results[f"{loss_type}-{beta}-{correction}"] = {
        "loss": loss.detach(),
        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None},
    }
torch.save(results, out_path)
"""


def equal_prompt_rollouts(hf) -> dict:
    """PROMPTS prompts of one length (TRL's positions count from the left edge of a left-padded prompt: none is
    padded here), G completions each of different lengths, right-padded."""
    g = torch.Generator().manual_seed(0)
    vocab, image_id = hf.config.text_config.vocab_size, hf.config.image_token_index
    prompts, completions = [], []
    for _ in range(PROMPTS):
        text = torch.randint(3, vocab - 1, (PROMPT_TEXT,), generator=g)
        prompt = torch.cat([torch.tensor([1]), torch.full((hf.config.image_seq_length,), image_id), text])
        for i in range(G):
            prompts.append(prompt)
            completions.append(torch.randint(3, vocab - 1, (2 + i,), generator=g))
    return {"prompts": torch.stack(prompts), "completions": completions,
            "pixels": torch.randn(PROMPTS, 3, 28, 28, generator=g).repeat_interleave(G, 0)}  # fmt: skip


@pytest.fixture(scope="module")
def trl_results(tmp_path_factory):
    site = cached_site("trl-1.16.0", TRL_PINS)
    root = tmp_path_factory.mktemp("grpo_trl")
    hf = tiny_llava(seed=0)
    r = equal_prompt_rollouts(hf)
    rows, p = r["prompts"].shape
    completion_ids = torch.zeros(rows, MAX_NEW, dtype=torch.long)
    completion_mask = torch.zeros(rows, MAX_NEW, dtype=torch.long)
    for i, c in enumerate(r["completions"]):
        completion_ids[i, : len(c)], completion_mask[i, : len(c)] = c, 1
    neva = neva_case(hf, r, p)
    case = {
        "cases": CASES, "out_dir": str(root / "trl"), "rows": rows, "group": G, "max_new": MAX_NEW,
        "prompt_ids": r["prompts"], "prompt_mask": torch.ones_like(r["prompts"]), "completion_ids": completion_ids,
        "completion_mask": completion_mask, "advantages": neva["advantages"], "pixel_values": r["pixels"],
        # neva's aligned per-token tensors hold completion token j at column p - 1 + j
        "old_per_token_logps": neva["old"][:, p - 1 : p - 1 + MAX_NEW].contiguous(),
        "ref_per_token_logps": neva["ref"][:, p - 1 : p - 1 + MAX_NEW].contiguous(),
    }  # fmt: skip
    torch.save(case, root / "case.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": f"{site}{os.pathsep}{REPO}"}
    cmd = [sys.executable, "-c", DRIVER, str(root / "case.pt"), str(root / "out.pt")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(root / "out.pt"), neva


def neva_case(hf, r: dict, p: int) -> dict:
    """The rollouts as neva's batch, the recorded old log-probs (moved by noise, so that ratios leave the clip range)
    and the reference's (a second tiny model), aligned with the batch."""
    rows = r["prompts"].shape[0]
    width = p + MAX_NEW
    input_ids = torch.zeros(rows, width, dtype=torch.long)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    for i, c in enumerate(r["completions"]):
        input_ids[i, :p], input_ids[i, p : p + len(c)], labels[i, p : p + len(c)] = r["prompts"][i], c, c
    media = Media(image=MediaInputs(r["pixels"], None, items_per_row=torch.ones(rows, dtype=torch.long)))
    batch = MicroBatch(input_ids=input_ids, labels=labels, position_ids=torch.arange(width).expand(1, rows, width),
                       media=media, stage=RolloutRows(advantages=group_advantages(REWARDS, G, "group")[0]))  # fmt: skip
    policy = neva_from_hf(hf)
    engine = Engine(ParallelModel([policy], Layout(), None, policy), Precision(), torch.device("cpu"), packed=False)
    old = record_old_logps(engine, [batch])[0].stage.old_token_logps
    old = old + 0.4 * torch.randn(old.shape, generator=torch.Generator().manual_seed(3))
    ref = token_forward(engine, neva_from_hf(tiny_llava(seed=1)).requires_grad_(False))(batch)
    return {
        "batch": batch.with_stage(old_token_logps=old),
        "old": old,
        "ref": ref,
        "advantages": batch.stage.advantages,
    }


@pytest.mark.parametrize("loss_type,beta,correction", CASES)
def test_update_equals_trl_grpo_trainer(trl_results, loss_type, beta, correction):
    torch.set_num_threads(1)
    theirs, neva = trl_results
    theirs = theirs[f"{loss_type}-{beta}-{correction}"]
    hf = tiny_llava(seed=0)
    policy = neva_from_hf(hf)
    cfg = GRPOConfig(num_generations=G, loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=0.28,
                     max_new_tokens=MAX_NEW, num_iterations=2, kl_ratio_correction=correction)  # fmt: skip
    objective = GroupPolicyObjective(cfg)
    engine = Engine(ParallelModel([policy], Layout(), None, policy), Precision(), torch.device("cpu"), packed=False,
                    head=objective, objectives=(objective,))  # fmt: skip
    batch = neva["batch"].with_stage(ref_token_logps=neva["ref"]) if beta else neva["batch"]
    loss, _ = engine.forward_backward([batch])
    torch.testing.assert_close(loss, theirs["loss"], rtol=1e-5, atol=1e-6)
    prefixes = detect_prefixes(hf.state_dict().keys())
    ours = {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}
    checked = 0
    for name, grad in theirs["grads"].items():
        key = hf_key_to_neva(name, prefixes)
        if key in ours and grad.abs().sum():
            torch.testing.assert_close(ours[key], grad, rtol=1e-4, atol=1e-6, msg=name)
            checked += 1
    assert checked > 10
    print(f"\n{loss_type} beta={beta} correction={correction}: neva {float(loss):.8f}  TRL {float(theirs['loss']):.8f}")
