"""Generation against transformers' ``generate`` (greedy, with images, left-padded batches) and its logits processors."""

import warnings

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from neva.models.generation import (
    GenerationConfig,
    apply_repetition_penalty,
    apply_top_k,
    apply_top_p,
    generate,
    left_pad,
)
from tests.checkpoint.tiny_hf import one_thread
from tests.hf_oracle import neva_from_hf, tiny_llava

EOS, PAD, NEW = 2, 0, 8


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def models():
    hf = tiny_llava(seed=3)
    return hf, neva_from_hf(hf)


def prompt(cfg, n_images: int, text_len: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = [1]  # BOS
    for _ in range(n_images):
        ids += torch.randint(3, cfg.image_token_id - 1, (2,), generator=g).tolist()
        ids += [cfg.image_token_id] * cfg.num_image_tokens
    return ids + torch.randint(3, cfg.image_token_id - 1, (text_len,), generator=g).tolist()


def hf_greedy(hf, prompts: list[list[int]], pixels: torch.Tensor | None) -> list[list[int]]:
    """HF generate on a left-padded batch; rows cut after their first EOS (HF pads them afterwards)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(
        input_ids=ids,
        attention_mask=mask,
        pixel_values=pixels,
        max_new_tokens=NEW,
        do_sample=False,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )[:, width:]
    rows = []
    for row in out.tolist():
        rows.append(row[: row.index(EOS) + 1] if EOS in row else row)
    return rows


def ours_greedy(model, prompts, pixels, counts=None):
    cfg = GenerationConfig(max_new_tokens=NEW, eos_token_ids=(EOS,), pad_token_id=PAD)
    return generate(model, prompts, pixels, counts, cfg)


def test_greedy_single_prompt_matches_hf(models):
    hf, ours = models
    p = prompt(ours.cfg, 1, 7, seed=0)
    pixels = torch.randn(1, 3, 28, 28)
    assert ours_greedy(ours, [p], pixels) == hf_greedy(hf, [p], pixels)


def test_greedy_left_padded_batch_matches_hf(models):
    hf, ours = models
    prompts = [prompt(ours.cfg, 1, 9, seed=1), prompt(ours.cfg, 2, 3, seed=2), prompt(ours.cfg, 0, 5, seed=3)]
    pixels = torch.randn(3, 3, 28, 28, generator=torch.Generator().manual_seed(0))
    expected = hf_greedy(hf, prompts, pixels)
    assert ours_greedy(ours, prompts, pixels, [1, 2, 0]) == expected
    # The oracle itself: padding must not change a row's continuation.
    assert hf_greedy(hf, prompts[:1], pixels[:1]) == expected[:1]


def test_cached_decoding_equals_full_recompute(models):
    _, ours = models
    prompts = [prompt(ours.cfg, 0, 4, seed=4), prompt(ours.cfg, 0, 11, seed=5)]
    got = ours_greedy(ours, prompts, None)
    for p, tokens in zip(prompts, got):
        seq = list(p)
        with torch.no_grad():
            for _ in range(len(tokens)):
                seq.append(int(ours(torch.tensor([seq]))[0, -1].argmax()))
        assert seq[len(p) :] == tokens


def test_left_pad_layout():
    batch = left_pad([[5, 6, 7], [8]], max_new_tokens=2, pad_id=0, device=torch.device("cpu"))
    assert batch.input_ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch.segment_ids.tolist() == [[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]
    assert batch.position_ids.tolist() == [[[0, 1, 2], [0, 0, 0]]]


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_hf(penalty):
    torch.manual_seed(0)
    logits, ids = torch.randn(3, 50), torch.randint(0, 50, (3, 12))
    seen = torch.zeros(3, 50, dtype=torch.bool).scatter_(1, ids, True)
    expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    assert torch.equal(apply_repetition_penalty(logits, seen, penalty), expected)


@pytest.mark.parametrize("k,p", [(5, 1.0), (0, 0.8), (7, 0.5), (1, 0.9)])
def test_warpers_match_hf(k, p):
    torch.manual_seed(1)
    logits, ids = torch.randn(4, 64), torch.zeros(4, 1, dtype=torch.long)
    expected = TemperatureLogitsWarper(0.7)(ids, logits.clone())
    if k:
        expected = TopKLogitsWarper(k)(ids, expected)
    if p < 1:
        expected = TopPLogitsWarper(p)(ids, expected)
    assert torch.equal(apply_top_p(apply_top_k(logits / 0.7, k), p), expected)


def test_sampling_is_seeded_and_top_k_1_is_greedy(models):
    _, ours = models
    prompts = [prompt(ours.cfg, 0, 6, seed=6)]
    sample = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=1.5, top_p=0.95, repetition_penalty=1.1)
    a = generate(ours, prompts, config=sample, generator=torch.Generator().manual_seed(0))
    b = generate(ours, prompts, config=sample, generator=torch.Generator().manual_seed(0))
    assert a == b
    top1 = GenerationConfig(max_new_tokens=6, do_sample=True, top_k=1)
    assert generate(ours, prompts, config=top1) == generate(ours, prompts, config=GenerationConfig(max_new_tokens=6))


def test_eos_and_stop_strings_end_rows_independently(models):
    _, ours = models
    prompts = [prompt(ours.cfg, 0, 6, seed=7), prompt(ours.cfg, 0, 9, seed=8)]
    free = generate(ours, prompts, config=GenerationConfig(max_new_tokens=8))
    eos = free[0][2]
    cut = generate(ours, prompts, config=GenerationConfig(max_new_tokens=8, eos_token_ids=(eos,)))
    assert cut[0] == free[0][: free[0].index(eos) + 1]
    assert cut[1] == (free[1][: free[1].index(eos) + 1] if eos in free[1] else free[1])

    def decode(ids):
        return "".join(f"<t{i}>" for i in ids)

    stop = f"<t{free[1][3]}>"
    stopped = generate(ours, prompts, config=GenerationConfig(max_new_tokens=8, stop_strings=(stop,)), decode=decode)
    assert stop in decode(stopped[1]) and stop not in decode(stopped[1][:-1])
    for row, full in zip(stopped, free):
        assert row == (full[: full.index(free[1][3]) + 1] if free[1][3] in full else full)


def test_max_new_tokens_beyond_the_context_is_capped_with_a_warning(models):
    """A request for a billion new tokens would reserve a KV cache of that length up front (and never end); it stops
    where prompt and answer fill the model's context instead."""
    _, ours = models
    context = ours.cfg.llm.max_seq_len
    prompts = [prompt(ours.cfg, 0, 5, seed=9), prompt(ours.cfg, 0, 12, seed=10)]
    with pytest.warns(UserWarning, match=f"max_new_tokens=1000000000 does not fit .*max_seq_len={context}"):
        out = generate(ours, prompts, config=GenerationConfig(max_new_tokens=10**9))
    width = max(len(p) for p in prompts)
    assert [len(row) for row in out] == [context - width] * 2  # no EOS configured: every row runs to the context
    # What fits is neither capped nor warned about, and the capped rows begin like a shorter request.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert generate(ours, prompts, config=GenerationConfig(max_new_tokens=8)) == [row[:8] for row in out]
    with pytest.raises(ValueError, match=f"leaves no room in the model's context of {context}"):
        generate(ours, [[1] * context], config=GenerationConfig(max_new_tokens=1))


def test_repeats_decode_each_prompt_once_prefilled_as_repeated_prompts(models):
    """``repeats=G`` (a prompt and its image prefilled once, its cache repeated; the online RL stage's groups) gives
    what the prompts repeated G times give: greedy, and sampled with one generator per row, whose draws depend on the
    row's seed alone (the rows of another batch composition draw the same)."""
    _, ours = models
    cfg = ours.cfg
    prompts = [prompt(cfg, 1, 3, seed=4), prompt(cfg, 1, 5, seed=5)]
    pixels = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(6))
    group = 3
    repeated = [p for p in prompts for _ in range(group)]
    repeated_pixels = pixels.repeat_interleave(group, 0)
    greedy = GenerationConfig(max_new_tokens=NEW, eos_token_ids=(EOS,), pad_token_id=PAD)
    assert generate(ours, prompts, pixels, None, greedy, repeats=group) == generate(ours, repeated, repeated_pixels,
                                                                                    None, greedy)  # fmt: skip
    sample = GenerationConfig(max_new_tokens=NEW, do_sample=True, temperature=1.5, top_k=20, pad_token_id=PAD)
    gens = lambda seeds: [torch.Generator().manual_seed(s) for s in seeds]  # noqa: E731
    seeds = list(range(10, 10 + 2 * group))
    once = generate(ours, prompts, pixels, None, sample, generator=gens(seeds), repeats=group)
    assert once == generate(ours, repeated, repeated_pixels, None, sample, generator=gens(seeds))
    assert len({tuple(r) for r in once}) > 2  # the group's rows differ
    alone = generate(ours, prompts[1:], pixels[1:], None, sample, generator=gens(seeds[group:]), repeats=group)
    assert alone == once[group:]


def test_suppressed_tokens_are_never_chosen(models):
    """``suppress_tokens`` (HF's): greedy and sampled rows never emit them (the online RL stage suppresses the image
    placeholder)."""
    _, ours = models
    prompts = [prompt(ours.cfg, 0, 4, seed=7)]
    free = generate(ours, prompts, config=GenerationConfig(max_new_tokens=4))[0]
    banned = generate(ours, prompts, config=GenerationConfig(max_new_tokens=4, suppress_tokens=(free[0],)))[0]
    assert banned[0] != free[0]
    sample = GenerationConfig(max_new_tokens=12, do_sample=True, temperature=5.0, suppress_tokens=tuple(range(3, 90)))
    out = generate(ours, prompts, config=sample, generator=torch.Generator().manual_seed(0))[0]
    assert all(t < 3 or t >= 90 for t in out)
