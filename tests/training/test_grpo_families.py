"""The online RL stage on the families whose prompts bring more than ids and fixed-size images: Qwen2.5-VL's native
resolution (each image its own patch grid, the prompt's M-RoPE positions) and AnyRes (each image tiled by its size,
LLaVA-OneVision's pooled ``anyres_max_1``), from prompt records whose images are not square (a height / width swap
or a wrong grid shows).

- The rollouts' greedy completions (batched, left-padded, KV cache, ``repeats``) equal a plain greedy decode of each
  prompt alone by full forwards without a cache, whose positions the data path's functions give over the whole
  sequence (``neva.models.mrope.mrope_positions``; AnyRes: the sample's own feature index, positions from the ids).
- One update (μ = 2: recorded old log-probs, moved so that ratios clip) on sampled completions has the loss and the
  gradients (the tower's and the projector's included) of the direct computation from those full forwards, each
  completion after its own copy of the prompt and its images (the update runs a group's prompt, images included, once:
  shared-prompt rows, ``neva.data.grpo_rows``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from neva.constants import IGNORE_INDEX
from neva.models.generation import GenerationConfig
from neva.models.grpo_loss import group_advantages
from neva.models.media import Media, MediaInputs
from neva.models.mrope import mrope_positions
from neva.training.grpo import record_old_logps
from neva.training.rollouts import InRunRollouts
from tests.parallel.harness import FAMILIES, make_checkpoint
from tests.parallel.test_grpo_layouts import GRPO_BASE
from tests.training.test_grpo_objective import direct_loss, token_logps

G, MAX_NEW = 2, 5
# (height, width) of each prompt's image: a wide and a tall one (AnyRes: 1x2 and 2x1 tile grids)
SIZES = [(28, 64), (64, 28)]


def prompt_records(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    with open(root / "prompts.jsonl", "w") as f:
        for i, (h, w) in enumerate(SIZES):
            pixels = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()
            Image.fromarray(pixels).save(root / f"{i}.png")
            f.write(
                json.dumps(
                    {"id": f"p{i}", "image": f"{i}.png", "problem": "what is it?" + " really?" * i, "answer": "red"}
                )
            )
            f.write("\n")
    return root


def stage_module(tmp_path: Path, family: str):
    """The GRPO stage's module (engine, its step) from a seeded checkpoint of ``family``, and its first micro-batch."""
    from neva.checkpoint.source import resolve_source
    from neva.config import compose_config
    from neva.parallel.layout import resolve_layout
    from neva.training.module import NevaModule, StepBatches
    from neva.training.run import data_module_type

    data_dir = prompt_records(tmp_path / "data")
    cfg = compose_config(GRPO_BASE + FAMILIES[family] + [
        f"model.restore_from_path={make_checkpoint(tmp_path / 'ckpt', family)}", f"exp_manager.exp_dir={tmp_path}/exp",
        f"model.data.data_path={data_dir / 'prompts.jsonl'}", f"model.data.image_folder={data_dir}",
        "model.global_batch_size=2", f"model.grpo.num_generations={G}", f"model.grpo.max_new_tokens={MAX_NEW}",
        "model.grpo.beta=0.0", "model.grpo.epsilon_high=0.28",
    ])  # fmt: skip
    layout = resolve_layout(cfg)
    source = resolve_source(cfg)
    data = data_module_type(cfg)(cfg.model.data, source.tokenizer, source.cfg, micro_batch_size=2, dp_rank=0,
                                 dp_world=1, seed=cfg.model.seed, accumulation=layout.grad_accum)  # fmt: skip
    data.setup("fit")
    module = NevaModule(cfg, source, data, layout)
    module.configure_model()
    (batch,) = next(iter(StepBatches(data, layout.grad_accum)))
    assert sorted(r["id"] for r in batch["records"]) == ["p0", "p1"]
    return module, batch


def full_forward(model, prompt: dict, ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[S, V]`` of one prompt sample's images and the ids ``ids`` (prompt + any continuation), without a
    cache: positions over the whole sequence from the data path's rules, the image positions found in the ids."""
    cfg = model.cfg
    cols = (ids == cfg.image_token_id).nonzero().flatten()
    where = torch.stack([torch.zeros_like(cols), cols], 1)
    image = MediaInputs(prompt["pixel_values"], where, items_per_row=torch.tensor([1]))
    if "image_grid" in prompt:
        image.grid = prompt["image_grid"]
        positions, _ = mrope_positions(ids, prompt["image_grid"], spatial_merge_size=cfg.vision.spatial_merge_size,
                                       image_token_id=cfg.image_token_id, video_token_id=-1,
                                       family=cfg.vision.kind)  # fmt: skip
    else:
        image.index, image.weight = prompt["image_feature_index"], prompt.get("image_feature_weight")
        positions = torch.arange(len(ids))[None]
    return model(ids[None], Media(image=image), position_ids=positions[:, None])[0]


@pytest.mark.parametrize("family", ["qwen2_5_vl_native", "llama_clip_anyres"])
def test_rollouts_and_update_on_native_and_anyres_prompts(tmp_path, family):
    torch.set_num_threads(1)
    module, batch = stage_module(tmp_path, family)
    engine, step, prompts = module.engine, module.stage_step, batch["prompts"]
    model = engine.parts[0]
    image_id = model.cfg.image_token_id
    # the two prompts differ in length (left padding) and in their images' layouts
    assert len({len(p["input_ids"]) for p in prompts}) == 2
    if family.startswith("qwen"):  # (h, w) patches of the wide image and of the tall one
        (h, w), other = [p["image_grid"][0, 1:].tolist() for p in prompts]
        assert h != w and other == [w, h]
    else:
        assert [p["image_sizes"] for p in prompts] == [[SIZES[int(r["id"][1:])]] for r in batch["records"]]

    greedy = GenerationConfig(max_new_tokens=MAX_NEW, pad_token_id=step.pad_id, suppress_tokens=(image_id,))
    rollouts = InRunRollouts(engine, greedy, step.tokenizer.decode)
    got = rollouts.sample(prompts, G, [0] * (len(prompts) * G))
    model.eval()
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            ids = prompt["input_ids"]
            for _ in range(MAX_NEW):  # the plain greedy decode (no EOS in a random tiny model's first tokens)
                logits = full_forward(model, prompt, ids)[-1]
                logits[image_id] = float("-inf")
                ids = torch.cat([ids, logits.argmax()[None]])
            expected = ids[len(prompt["input_ids"]) :].tolist()
            assert got[i * G] == got[i * G + 1] == expected, (family, i)
    model.train()

    # One update on sampled completions (the stage's rollouts), as the stage's step builds it.
    rewards = torch.tensor([1.0, 0.0, 0.3, 0.9])
    seeds = list(range(len(prompts) * G))
    completions = step.rollouts.sample(prompts, G, seeds)
    made = [{"prompt": p, "ids": completions[i * G + j]} for i, p in enumerate(prompts) for j in range(G)]
    advantages = group_advantages(rewards, G, "group")[0]
    (rows,) = step._row_batches([made], advantages, torch.ones(len(made), dtype=torch.bool))
    assert rows["media"].image.pixels.shape[0] == sum(p["pixel_values"].shape[0] for p in prompts)  # once per group
    assert rows.get("shared_prefix")  # one process: each prompt once in its group's row (``neva.data.grpo_rows``)
    rows = record_old_logps(engine, [rows])[0]
    noise = 0.4 * torch.randn(rows["old_token_logps"].shape, generator=torch.Generator().manual_seed(3))
    rows["old_token_logps"] = rows["old_token_logps"] + noise
    loss, _ = engine.forward_backward([rows])

    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    total = 0.0
    width = max(len(row["prompt"]["input_ids"]) + len(row["ids"]) for row in made)
    lps, masks, olds = [], [], []
    for r, row in enumerate(made):
        completion = torch.tensor(row["ids"])
        ids = torch.cat([row["prompt"]["input_ids"], completion])
        labels = torch.full((width,), IGNORE_INDEX)
        labels[len(ids) - len(completion) : len(ids)] = completion
        logits = torch.zeros(width, model.cfg.llm.vocab_size)
        logits = torch.cat([full_forward(model, row["prompt"], ids), logits[len(ids) :]])
        lp, mask = token_logps(logits[None], labels[None])
        # the recorded old log-probs of this completion's tokens, where its own row would hold them
        at = rows["completion_at"] == r
        assert torch.equal(rows["input_ids"].roll(-1, 1)[at], completion)  # its tokens, in order, once
        old = torch.zeros(1, width - 1)
        old[0, len(ids) - len(completion) - 1 : len(ids) - 1] = rows["old_token_logps"][at]
        lps.append(lp), masks.append(mask), olds.append(old)
    lp, mask, old = torch.cat(lps), torch.cat(masks), torch.cat(olds)
    cfg = step.g
    assert (cfg.loss_type, cfg.beta, cfg.epsilon, cfg.epsilon_high) == ("grpo", 0.0, 0.2, 0.28)  # direct_loss's
    total, _, clip = direct_loss(lp, old, lp.detach(), advantages, mask, "grpo", 0.0)
    torch.testing.assert_close(loss, total.detach(), rtol=1e-5, atol=1e-6)
    assert 0 < float(clip) < 1
    assert engine.aux_metrics["clip_fraction"] == pytest.approx(float(clip), abs=1e-6)
    grads = torch.autograd.grad(total, list(params.values()), allow_unused=True)
    checked = set()
    for (name, p), grad in zip(params.items(), grads):
        if grad is None or not grad.abs().sum():
            assert p.grad is None or not p.grad.abs().sum(), name
            continue
        torch.testing.assert_close(p.grad, grad, rtol=1e-4, atol=1e-6, msg=name)
        checked.add(name.split(".")[0])
    assert {"llm", "projector"} <= checked, checked
