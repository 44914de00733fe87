"""Qwen3.5's hybrid decoder beyond the shared Qwen-VL tests (tests/checkpoint/test_qwen_vl_hf.py: logits on images and
text, packed rows, greedy generation, export): the chunked delta rule against transformers' token-by-token one,
video logits, packed rows across chunk boundaries, and one training step's loss and gradient norm, each against
transformers' own code and classes."""

from __future__ import annotations

import pytest
import torch

from neva.checkpoint.hf_qwen_vl import import_qwen_vl
from neva.checkpoint.neva_format import load_model
from neva.models.delta_rule import chunked_delta_rule, delta_rule_step
from neva.models.loss import token_cross_entropy
from neva.models.media import Media, MediaInputs
from neva.models.mrope import mrope_positions
from tests.checkpoint.tiny_hf import one_thread
from tests.fixtures.tiny_qwen_vl import MERGE, PATCHES, qwen_tokenizer, tiny_qwen_vl_dir
from tests.models.test_hf_parity import rel_err


def _rule_inputs(seed: int, length: int):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, length, 2, 8, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(2, length, 4, 12, generator=g, requires_grad=True)
    decay = (-torch.rand(2, length, 4, generator=g) * 2).requires_grad_()
    beta = torch.rand(2, length, 4, generator=g).requires_grad_()
    state = torch.randn(2, 4, 8, 12, generator=g)
    return q, k, v, decay, beta, state


def test_chunked_rule_and_decoding_step_equal_the_token_recurrence():
    """150 tokens (four whole chunks of 32 and a part), two value heads per key head, a starting state: outputs, final
    state and gradients = transformers' ``torch_recurrent_gated_delta_rule``; one decoding step continues it."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule as reference

    with one_thread():
        q, k, v, decay, beta, state = _rule_inputs(0, 150)
        ours, ours_state = chunked_delta_rule(q, k, v, decay, beta, state)
        theirs, their_state = reference(
            q, k, v, decay, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        assert rel_err(ours, theirs) < 1e-5 and rel_err(ours_state, their_state) < 1e-5
        weights = torch.randn_like(ours)
        ours_grads = torch.autograd.grad((ours * weights).sum(), (q, k, v, decay, beta))
        their_grads = torch.autograd.grad((theirs * weights).sum(), (q, k, v, decay, beta))
        for a, b in zip(ours_grads, their_grads):
            assert rel_err(a, b) < 1e-5
        step = [t[:, :1].detach() for t in _rule_inputs(1, 1)[:5]]
        out, new_state = delta_rule_step(*step, state=their_state.detach())
        ref, ref_state = reference(
            *step, initial_state=their_state.detach(), output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        assert rel_err(out, ref) < 1e-6 and rel_err(new_state, ref_state) < 1e-6


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def imported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    with one_thread():
        hf_dir = tiny_qwen_vl_dir(root, request.param)
        ckpt = import_qwen_vl(hf_dir, root / "neva")
    return request.param, hf_dir, ckpt


def _video_prompt(seed: int):
    """A prompt with a 2-frame video as Qwen3.5's processor writes one (a timestamp and a vision block per frame), its
    patches ``[2·4·4, C·T·P·P]`` and grid (2, 4, 4): 4 tokens per frame."""
    tok = qwen_tokenizer()
    frame = "<|vision_start|>" + "<|video_pad|>" * 4 + "<|vision_end|>"
    text = f"<|im_start|>user\n<0.5 seconds>{frame}<1.5 seconds>{frame}What moves?<|im_end|>"
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    video = tok.convert_tokens_to_ids("<|video_pad|>")
    g = torch.Generator().manual_seed(seed)
    patches = torch.randn(2 * 4 * 4, 3 * 2 * PATCHES["qwen3_5"] ** 2, generator=g)
    return ids, video, patches, torch.tensor([[2, 4, 4]])


def test_video_logits_equal_transformers(imported):
    from transformers import AutoModelForImageTextToText

    _, hf_dir, ckpt = imported
    ids, video, patches, grid = _video_prompt(0)
    with one_thread(), torch.no_grad():
        hf = AutoModelForImageTextToText.from_pretrained(str(hf_dir)).eval()
        model = load_model(ckpt).eval()
        kinds = 2 * (ids == video).long()
        theirs = hf(input_ids=ids, pixel_values_videos=patches, video_grid_thw=grid, mm_token_type_ids=kinds).logits
        positions, _ = mrope_positions(
            ids[0], video_grids=grid, spatial_merge_size=MERGE, image_token_id=model.cfg.image_token_id,
            video_token_id=video, family="qwen3_vl",
        )  # fmt: skip
        media = Media(video=MediaInputs(patches, positions=(ids == video).nonzero(), grid=grid))
        ours = model(ids, media, position_ids=positions[:, None])
    assert rel_err(ours, theirs) < 1e-5


def test_packed_samples_across_chunks_equal_each_alone(imported):
    """Three text samples (64, 30 and 90 tokens: chunk boundaries inside two of them, the first two ending within the
    convolution's reach of a chunk boundary) in one row, and right padding: each sample's logits = the sample alone
    (the convolution and the state restart at each), within 1e-6."""
    _, _, ckpt = imported
    lengths = (64, 30, 90)
    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, 390, (n,), generator=g) for n in lengths]
    row = torch.cat([*samples, torch.zeros(7, dtype=torch.long)])[None]
    segments = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)] + [torch.zeros(7, dtype=torch.long)])
    positions = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(7, dtype=torch.long)])[None]
    with one_thread(), torch.no_grad():
        model = load_model(ckpt).eval()
        packed = model(row, position_ids=positions, segment_ids=segments[None])[0]
        start = 0
        for sample in samples:
            alone = model(sample[None])[0]
            assert rel_err(packed[start : start + len(sample)], alone) < 1e-6
            start += len(sample)


def test_training_step_loss_and_gradient_norm_equal_transformers(imported):
    """One step on a video prompt and its reply: the summed-token loss and every parameter's gradient norm."""
    from transformers import AutoModelForImageTextToText

    _, hf_dir, ckpt = imported
    ids, video, patches, grid = _video_prompt(1)
    labels = ids.clone()
    labels[:, : ids.shape[1] // 2] = -100
    with one_thread():
        hf = AutoModelForImageTextToText.from_pretrained(str(hf_dir)).train()
        model = load_model(ckpt).train()
        kinds = 2 * (ids == video).long()
        theirs = hf(
            input_ids=ids, pixel_values_videos=patches, video_grid_thw=grid, mm_token_type_ids=kinds, labels=labels
        ).loss
        theirs.backward()
        positions, _ = mrope_positions(
            ids[0], video_grids=grid, spatial_merge_size=MERGE, image_token_id=model.cfg.image_token_id,
            video_token_id=video, family="qwen3_vl",
        )  # fmt: skip
        media = Media(video=MediaInputs(patches, positions=(ids == video).nonzero(), grid=grid))
        loss_sum, count = token_cross_entropy(model(ids, media, position_ids=positions[:, None]), labels)
        ours = loss_sum / count
        ours.backward()
    assert abs(ours.item() - theirs.item()) <= 1e-5 * theirs.item()
    norms = [torch.stack([p.grad.norm() for p in m.parameters() if p.grad is not None]).norm() for m in (model, hf)]
    assert abs(norms[0] - norms[1]) <= 1e-5 * norms[1]
