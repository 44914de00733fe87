"""neva's decoder with M-RoPE against transformers (tiny random models, fp32, CPU): the rotary tables of Qwen2-VL
(sectioned) and Qwen3-VL (interleaved), Qwen3's q/k norms, whole-decoder logits from 3-D positions, a packed row of
three samples (positions by neva/models/mrope.py through the collator) = each sample alone, and greedy decoding with
the KV cache = argmax of HF's full-sequence forwards at HF's decode positions, left-padded batch included."""

import pytest
import torch
from transformers import Qwen2VLTextConfig, Qwen3Config, Qwen3ForCausalLM, Qwen3VLTextConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

from neva.constants import IGNORE_INDEX
from neva.data.collate import collate_packed
from neva.models.config import LLMConfig, NevaConfig
from neva.models.generation import GenerationConfig, generate
from neva.models.llama import LlamaDecoder
from neva.models.mrope import mrope_positions
from neva.models.neva import NevaModel
from neva.models.rope import rope_cos_sin, rope_inv_freq
from tests.checkpoint.tiny_hf import one_thread
from tests.models.qwen_vl_oracle import (
    IMAGE,
    MERGE,
    VIDEO,
    VOCAB,
    item,
    llm_config,
    qwen3_video,
    text,
    text_config,
    tiny_qwen_vl,
)
from tests.models.test_hf_parity import load_part, rel_err

VL = ["qwen2_vl", "qwen3_vl"]


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module", params=VL)
def family(request):
    hf = tiny_qwen_vl(request.param, seed=3)
    ours = LlamaDecoder(llm_config(request.param)).eval()
    load_part(ours, hf.state_dict(), "llm")
    return request.param, hf, ours


def positions(family: str, ids: list[int], images=(), videos=()) -> tuple[torch.Tensor, int]:
    return mrope_positions(
        torch.tensor(ids),
        torch.tensor(list(images)).reshape(-1, 3),
        torch.tensor(list(videos)).reshape(-1, 3),
        spatial_merge_size=MERGE,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        family=family,
    )


def prompts(family: str) -> list[tuple[list[int], list, list]]:
    """(ids, image grids, video grids): an image and text; two images; a video (Qwen3-VL's per-frame layout)."""
    video = qwen3_video((2, 4, 4), 30) if family == "qwen3_vl" else item(VIDEO, (2, 4, 4))
    return [
        (text(3, 1) + item(IMAGE, (1, 4, 6)) + text(5, 2), [(1, 4, 6)], []),
        (
            text(2, 3) + item(IMAGE, (1, 2, 4)) + text(1, 4) + item(IMAGE, (1, 6, 4)) + text(2, 5),
            [(1, 2, 4), (1, 6, 4)],
            [],
        ),
        (text(1, 6) + video + text(3, 7), [], [(2, 4, 4)]),
    ]


# The released models' layouts, head_dim 128: Qwen2-VL / Qwen2.5-VL's [16, 24, 24], Qwen3-VL's interleaved [24, 20, 20].
RELEASED = {
    "qwen2_vl": (Qwen2VLTextConfig, dict(rope_theta=1e6, mrope_section=[16, 24, 24])),
    "qwen3_vl": (Qwen3VLTextConfig, dict(rope_theta=5e6, mrope_section=[24, 20, 20], mrope_interleaved=True)),
}
ROTARY = {"qwen2_vl": Qwen2VLRotaryEmbedding, "qwen3_vl": Qwen3VLTextRotaryEmbedding}


@pytest.mark.parametrize("size", ["tiny", "released"])
@pytest.mark.parametrize("family", VL)
def test_rotary_tables_equal_hf(family, size):
    if size == "tiny":
        text_config = tiny_qwen_vl(family).config.text_config
        cfg = llm_config(family)
    else:
        config_cls, rope = RELEASED[family]
        text_config = config_cls(
            hidden_size=1024, num_attention_heads=8, head_dim=128, rope_parameters=dict(rope, rope_type="default")
        )
        cfg = LLMConfig(hidden_size=1024, num_heads=8, head_dim=128, **rope)
    hf = ROTARY[family](text_config)
    pos = torch.randint(0, 3000, (3, 2, 11))
    x = torch.zeros(2, 11, cfg.head_dim)
    hf_cos, hf_sin = hf(x, pos)
    cos, sin = rope_cos_sin(rope_inv_freq(cfg), pos, torch.float32, cfg.mrope_section, cfg.mrope_interleaved)
    assert torch.equal(cos[:, 0], hf_cos) and torch.equal(sin[:, 0], hf_sin)
    assert not torch.equal(cos, rope_cos_sin(hf.inv_freq, pos[:1], torch.float32, cfg.mrope_section)[0])
    # One axis given to an M-RoPE decoder: the three axes are equal.
    one, three = pos[:1], pos[:1].expand(3, -1, -1)
    for a, b in zip(
        rope_cos_sin(hf.inv_freq, one, torch.float32, cfg.mrope_section, cfg.mrope_interleaved),
        rope_cos_sin(hf.inv_freq, three, torch.float32, cfg.mrope_section, cfg.mrope_interleaved),
    ):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="3 position axes given to a decoder with one-axis RoPE"):
        rope_cos_sin(hf.inv_freq, pos, torch.float32)


def test_mrope_section_is_validated():
    base = dict(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=4)
    with pytest.raises(ValueError, match=r"sums to 9, not head_dim / 2 = 8"):
        LLMConfig(**base, mrope_section=[3, 3, 3])
    with pytest.raises(ValueError, match="3 non-negative counts"):
        LLMConfig(**base, mrope_section=[4, 4])
    with pytest.raises(ValueError, match="mrope_interleaved needs mrope_section"):
        LLMConfig(**base, mrope_interleaved=True)
    with pytest.raises(ValueError, match="cannot hold 3 and 3"):
        LLMConfig(**base, mrope_section=[2, 3, 3], mrope_interleaved=True)


def test_qk_norm_decoder_matches_qwen3():
    torch.manual_seed(0)
    settings = text_config("qwen3_vl")
    rope = dict(rope_type="default", rope_theta=settings["rope_parameters"]["rope_theta"])  # Qwen3's one-axis RoPE
    hf_cfg = Qwen3Config(**settings | dict(rope_parameters=rope))
    hf = Qwen3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    cfg = LLMConfig(**{**llm_config("qwen3_vl").__dict__, "mrope_section": None, "mrope_interleaved": False})
    ours = LlamaDecoder(cfg).eval()
    load_part(ours, hf.state_dict(), "llm")
    assert ours.layers["0"].attention.q_norm is not None
    ids = torch.randint(0, VOCAB, (2, 17))
    with torch.no_grad():
        assert rel_err(ours(ours.tok_embeddings(ids)), hf(input_ids=ids).logits) < 1e-5


def test_decoder_logits_match_hf_from_3d_positions(family):
    name, hf, ours = family
    rows = prompts(name)[:2]
    width = max(len(ids) for ids, *_ in rows)
    rows = [(ids + text(width - len(ids), 9), *grids) for ids, *grids in rows]  # two rows of one length
    pos = torch.stack([positions(name, *row)[0] for row in rows], dim=1)
    assert pos.shape[1:] == (2, width) and not torch.equal(pos[:, 0], pos[:, 1])
    embeds = torch.randn(2, width, ours.cfg.hidden_size)
    with torch.no_grad():
        expected = hf(inputs_embeds=embeds, position_ids=pos).logits
        got = ours(embeds, position_ids=pos)
        one_axis = ours(embeds)
    assert rel_err(got, expected) < 1e-5
    assert rel_err(one_axis, expected) > 1e-3  # the 3-D positions matter


def sample(name: str, ids: list[int], images, videos, index: int, rope: bool = True) -> dict:
    """One sample as the dataset hands it to the collator (no pixels: the decoder alone is under test)."""
    ids = torch.tensor(ids)
    labels = torch.where(torch.rand(len(ids), generator=torch.Generator().manual_seed(index)) < 0.5, ids, IGNORE_INDEX)
    out = dict(input_ids=ids, labels=labels, pixel_values=torch.zeros(0, 3, 4, 4), image_count=0, id=index)
    if rope:
        out["position_ids"] = positions(name, ids.tolist(), images, videos)[0]
    return out


def loss_and_grads(model: LlamaDecoder, batch: dict) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    logits = model(model.tok_embeddings(batch.input_ids), batch.position_ids, batch.segment_ids)
    out = batch.output_positions
    loss = torch.nn.functional.cross_entropy(logits[out[:, 0], out[:, 1]], batch.targets, reduction="sum")
    loss.backward()
    return logits.detach(), loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_packed_row_equals_each_sample_alone(family):
    name, _, ours = family
    (img, images, _), _, (vid, _, videos) = prompts(name)
    samples = [
        sample(name, img, images, [], 1),
        sample(name, text(7, 11), [], [], 2, rope=False),  # text only: one axis, broadcast over the three
        sample(name, vid, [], videos, 3),
    ]
    packed = collate_packed(samples, pad_id=0, seq_length=128, pad_to_multiple_of=8)
    assert packed.position_ids.shape[0] == 3 and packed.segment_ids.max() == 3
    assert packed.segment_ids[0, -1] == 0  # padding after the three
    logits, loss, grads = loss_and_grads(ours, packed)
    start, total, summed = 0, 0.0, None
    for s in samples:
        alone = collate_packed([s], pad_id=0, seq_length=128, pad_to_multiple_of=1)
        n = s["input_ids"].numel()
        # The text-only sample alone is a one-axis batch: the decoder reads it as three equal axes.
        assert torch.equal(packed.position_ids[:, 0, start : start + n], alone.position_ids[:, 0].expand(3, -1))
        got, part, part_grads = loss_and_grads(ours, alone)
        assert rel_err(logits[0, start : start + n], got[0]) < 1e-5
        total += part
        summed = part_grads if summed is None else [a + b for a, b in zip(summed, part_grads)]
        start += n
    assert abs(loss - total) / total < 1e-5
    for g, e in zip(grads, summed):
        assert rel_err(g, e) < 1e-5


def hf_greedy_full_forwards(hf, name: str, rows: list[tuple], steps: int) -> list[list[int]]:
    """Argmax of HF's full-sequence forward per step, left-padded, at HF's own positions: ``get_rope_index`` for
    the prompt, ``cumsum(attention_mask) - 1 + rope_deltas`` for every new token (its decode rule); checked against
    HF's ``generate``. No pixels: the visual tokens are embedded as tokens (the decoder alone is under test)."""
    width = max(len(ids) for ids, *_ in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, (prompt, *_) in enumerate(rows):
        ids[r, width - len(prompt) :], mask[r, width - len(prompt) :] = torch.tensor(prompt), 1
    images = [g for _, gs, _ in rows for g in gs]
    videos = [g for *_, gs in rows for g in gs]
    prompt_pos, deltas = hf.model.get_rope_index(
        ids,
        mm_token_type_ids=(ids == IMAGE).int() + 2 * (ids == VIDEO).int(),
        image_grid_thw=torch.tensor(images) if images else None,
        video_grid_thw=torch.tensor(videos) if videos else None,
        attention_mask=mask,
    )
    out, prompt_ids, prompt_mask = [[] for _ in rows], ids, mask
    for _ in range(steps):
        text_pos = (mask.cumsum(-1) - 1)[:, width:] + deltas  # the new tokens' positions
        pos = torch.cat([prompt_pos, text_pos[None].expand(3, -1, -1)], dim=2)
        with torch.no_grad():
            logits = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1]
        token = logits.argmax(-1)
        for r in range(len(rows)):
            out[r].append(int(token[r]))
        ids, mask = torch.cat([ids, token[:, None]], 1), torch.cat([mask, torch.ones_like(token)[:, None]], 1)
    # transformers' own generate (KV cache, rope_deltas) decodes the same tokens.
    grids = {"image_grid_thw": torch.tensor(images)} if images else {}
    grids.update({"video_grid_thw": torch.tensor(videos)} if videos else {})
    kw = dict(attention_mask=prompt_mask, max_new_tokens=steps, do_sample=False, pad_token_id=0, **grids)
    generated = hf.generate(
        input_ids=prompt_ids, mm_token_type_ids=(prompt_ids == IMAGE).int() + 2 * (prompt_ids == VIDEO).int(), **kw
    )
    assert generated[:, width:].tolist() == out
    return out


def test_greedy_generation_with_cache_matches_hf_decode_positions(family):
    name, hf, ours = family
    model = NevaModel(NevaConfig(llm=ours.cfg, vision=None, projector=None, image_token_id=VOCAB)).eval()
    model.llm.load_state_dict(ours.state_dict())
    rows = prompts(name)[1:]  # 2 images (19 / 27 tokens), and the video: left padding on the shorter
    steps = 6
    expected = hf_greedy_full_forwards(hf, name, rows, steps)
    cfg = GenerationConfig(max_new_tokens=steps)
    got = generate(model, [ids for ids, *_ in rows], config=cfg, position_ids=[positions(name, *r)[0] for r in rows])
    assert got == expected
    single = generate(model, [rows[0][0]], config=cfg, position_ids=[positions(name, *rows[0])[0]])
    assert single == hf_greedy_full_forwards(hf, name, rows[:1], steps)
    one_axis = generate(model, [ids for ids, *_ in rows], config=cfg)
    assert one_axis != expected  # the 3-D positions, prefill and decode, decide the tokens
