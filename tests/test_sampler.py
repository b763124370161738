"""Sampler semantics against hand-computed cases."""

import math

import pytest
import torch

from wllm.engine.sampler import Sampler, SamplingRow, _apply_penalties, row_seed
from wllm.sampling_params import SamplingParams


def row(prompt=(), output=(), eos=(), seed=0, index=0, **params):
    return SamplingRow(SamplingParams(**params), seed, index, list(prompt), list(output), list(eos))


def penalised(logits, r):
    x = torch.tensor([logits], dtype=torch.float32)
    _apply_penalties(x, [r])
    return x[0].tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    got = penalised([2.0, -2.0, 1.0, 3.0], row(prompt=[0], output=[1], repetition_penalty=2.0))
    assert got == [1.0, -4.0, 1.0, 3.0]


def test_frequency_and_presence_penalties_use_output_counts_only():
    got = penalised([1.0, 1.0, 1.0, 1.0],
                    row(prompt=[3], output=[0, 0, 1], frequency_penalty=0.5, presence_penalty=0.25))
    assert got == pytest.approx([1.0 - 2 * 0.5 - 0.25, 1.0 - 0.5 - 0.25, 1.0, 1.0])


def test_logit_bias_and_min_tokens_mask_eos_and_stop_ids():
    got = penalised([0.0, 0.0, 0.0, 0.0], row(eos=[3], logit_bias={1: 5.0, 99: 1.0}, min_tokens=2,
                                               stop_token_ids=[2]))
    assert got == [0.0, 5.0, -math.inf, -math.inf]
    got = penalised([0.0, 0.0, 0.0, 0.0], row(output=[0, 0], eos=[3], min_tokens=2, stop_token_ids=[2]))
    assert got == [0.0, 0.0, 0.0, 0.0]
    got = penalised([0.0, 0.0, 0.0, 0.0], row(eos=[3], min_tokens=2, ignore_eos=True))
    assert got == [0.0, 0.0, 0.0, 0.0]


def test_greedy_picks_argmax_after_processing_and_reports_raw_logprobs():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    (tok,) = Sampler()(logits, [row(temperature=0, logprobs=2)])
    assert tok.token_id == 1
    raw = torch.log_softmax(logits[0], -1)
    assert tok.logprob == pytest.approx(raw[1].item())
    assert tok.logprobs.rank == 1
    assert [(t.token_id, t.logprob) for t in tok.logprobs.top] == [(1, pytest.approx(raw[1].item())),
                                                                    (2, pytest.approx(raw[2].item()))]
    (tok,) = Sampler()(logits, [row(temperature=0, logprobs=0, logit_bias={0: 10.0})])
    # The bias changes the choice, not the reported (raw model) distribution.
    assert tok.token_id == 0
    assert tok.logprob == pytest.approx(raw[0].item())
    assert tok.logprobs.rank == 3 and tok.logprobs.top == []


def draw(logits, n=200, **params):
    sampler = Sampler()
    return {sampler(torch.tensor([logits]), [row(seed=s, **params)])[0].token_id for s in range(n)}


def test_top_k_top_p_min_p_restrict_the_support():
    logits = [math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]
    assert draw(logits) == {0, 1, 2, 3}
    assert draw(logits, top_k=2) == {0, 1}
    # top_p 0.6: 0.5 alone does not reach it, 0.5 + 0.3 does -> tokens 0 and 1.
    assert draw(logits, top_p=0.6) == {0, 1}
    assert draw(logits, top_p=0.5) == {0}
    # min_p 0.25: keep p >= 0.125 -> tokens 0, 1, 2.
    assert draw(logits, min_p=0.25) == {0, 1, 2}
    assert draw(logits, top_k=1, temperature=5.0) == {0}


def test_sampling_frequencies_follow_the_distribution():
    logits = [math.log(0.7), math.log(0.3)]
    sampler = Sampler()
    hits = sum(sampler(torch.tensor([logits]), [row(seed=s)])[0].token_id == 0 for s in range(2000))
    assert 0.66 < hits / 2000 < 0.74


def test_seeded_stream_depends_only_on_seed_index_and_position():
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    rows = [row(seed=1234, output=[5] * 3)] + [row(seed=i) for i in range(7)]
    batch = Sampler()(logits, rows)
    alone = Sampler()(logits[:1], rows[:1])
    assert batch[0].token_id == alone[0].token_id
    # Another position or sequence index gives another stream.
    assert row_seed(1234, 0, 3) != row_seed(1234, 0, 4) != row_seed(1234, 1, 3)
    flat = torch.zeros(1, 1000)
    picks = {Sampler()(flat, [row(seed=1, output=[0] * k)])[0].token_id for k in range(20)}
    assert len(picks) > 10


def test_row_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="2 logit rows for 1"):
        Sampler()(torch.zeros(2, 4), [row()])
