"""GPU sampler: the PyTorch reference against the engine's CPU sampler and known answers (CPU, CI);
the CUDA kernel against the reference, for batch independence and inside a CUDA graph (-m cuda)."""

from __future__ import annotations

import math

import pytest
import torch

from wllm import kernels
from wllm.engine.cuda_graphs import capture_graph
from wllm.engine.sampler import Sampler, SamplingRow, _apply_penalties, _filter
from wllm.kernels import reference
from wllm.sampling_params import SamplingParams


def row(prompt=(), output=(), eos=(), seed=0, index=0, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), seed, index, list(prompt), list(output), list(eos))


def mixed_rows(vocab: int) -> list[SamplingRow]:
    """Every feature at least once: greedy/random, each filter, penalties, bias and bans."""
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, vocab, (40,), generator=g).tolist()
    return [
        row(temperature=0),
        row(prompt=toks[:10], output=toks[10:16], temperature=0, repetition_penalty=1.3, frequency_penalty=0.4,
            presence_penalty=0.3),
        row(output=toks[:3], eos=[toks[20]], temperature=0, logit_bias={toks[21]: 3.0, toks[22]: -2.0},
            min_tokens=5, stop_token_ids=[toks[23]]),
        row(seed=11, temperature=0.7),
        row(seed=12, temperature=1.0, top_k=5),
        row(seed=13, temperature=1.3, top_p=0.9),
        row(seed=14, temperature=0.8, min_p=0.05),
        row(seed=15, index=2, temperature=1.0, top_k=50, top_p=0.8, min_p=0.01),
        row(prompt=toks[:20], output=toks[20:30], seed=16, temperature=0.9, top_p=0.95, repetition_penalty=0.8,
            frequency_penalty=-0.5, presence_penalty=1.5, logit_bias={toks[0]: 4.0}),
        row(seed=17, temperature=2.0, top_k=1),
        row(output=[1] * 9, seed=18, temperature=1.0, top_k=vocab + 5, top_p=1.0),
    ]


def run_reference(logits: torch.Tensor, rows: list[SamplingRow], **kw):
    return reference.sample(logits, **kernels.pack_sampling_rows(rows, logits.device), **kw)


# ------------------------------------------------------------------------------------------
# References (CPU)
# ------------------------------------------------------------------------------------------


def test_philox_known_answers() -> None:
    """Random123's kat_vectors for Philox4x32-10."""
    cases = [([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
             ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
             ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
              [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1])]
    for counter, key, want in cases:
        got = reference.philox4x32([torch.tensor([c]) for c in counter], tuple(key))
        assert [int(w) for w in got] == want


def test_reference_matches_cpu_sampler_on_greedy_rows_and_logprobs() -> None:
    torch.manual_seed(1)
    vocab = 97
    rows = mixed_rows(vocab)
    logits = torch.randn(len(rows), vocab) * 3
    before = logits.clone()
    tokens, logprobs, raw = run_reference(logits, rows, return_logprobs=True)
    cpu = Sampler()(logits, rows)
    for i, r in enumerate(rows):
        if r.params.greedy:  # random rows use another generator than the CPU sampler's
            assert tokens[i].item() == cpu[i].token_id, f"row {i}"
            assert logprobs[i].item() == pytest.approx(cpu[i].logprob, abs=1e-5), f"row {i}"
    torch.testing.assert_close(raw, torch.log_softmax(before, -1))
    torch.testing.assert_close(logprobs, raw.gather(1, tokens[:, None])[:, 0])
    assert torch.equal(logits, before)


def test_reference_greedy_matches_cpu_when_a_penalised_token_wins() -> None:
    """Rows engineered so that the winner is a biased, banned or penalised token."""
    torch.manual_seed(2)
    vocab = 64
    for trial in range(20):
        toks = torch.randint(0, vocab, (12,)).tolist()
        r = row(prompt=toks[:6], output=toks[6:], eos=[toks[0]], temperature=0, repetition_penalty=1.7,
                frequency_penalty=0.3, presence_penalty=-0.2, logit_bias={toks[1]: 0.5}, min_tokens=10)
        logits = torch.randn(1, vocab)
        processed = logits.clone()
        _apply_penalties(processed, [r])
        # Make the argmax land on a processed token: everything else far below.
        target = toks[(trial % 11) + 1]
        logits[0] -= 100 * (processed[0] != processed[0, target]).float() * (torch.arange(vocab) != target).float()
        processed = logits.clone()
        _apply_penalties(processed, [r])
        tokens, _, _ = run_reference(logits, [r])
        assert tokens[0].item() == int(torch.argmax(processed[0])), f"trial {trial}"


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 1.0, 0.0), (7, 1.0, 0.0), (0, 0.9, 0.0), (0, 1.0, 0.1),
                                               (20, 0.7, 0.02), (1, 0.5, 0.5), (200, 0.99, 0.0)])
def test_sampling_mask_matches_cpu_filter(top_k: int, top_p: float, min_p: float) -> None:
    torch.manual_seed(3)
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p)
    for trial in range(10):
        x = torch.randn(150) * 2
        want = _filter(x, params) > 0
        got = reference.sampling_mask(x / torch.tensor(0.8), top_k, top_p, min_p)
        assert torch.equal(got, want), f"trial {trial}: kept {got.sum()} vs {want.sum()}"


def test_reference_seeded_sampling_is_batch_independent() -> None:
    torch.manual_seed(4)
    vocab = 500
    target = row(seed=42, output=[3, 4], temperature=1.0, top_p=0.95)
    logits = torch.randn(8, vocab)
    alone, _, _ = run_reference(logits[3:4], [target])
    others = [row(seed=s, temperature=1.0) for s in range(7)]
    batch, _, _ = run_reference(logits, others[:3] + [target] + others[3:])
    assert alone[0] == batch[3]
    # Another position or seed gives another stream.
    draws = {int(run_reference(logits[3:4], [row(seed=42, output=[0] * n, temperature=1.0)])[0][0])
             for n in range(12)}
    assert len(draws) > 3


def test_exponential_race_follows_the_softmax() -> None:
    """argmax(x - log E) with Philox exponentials draws tokens with probability softmax(x)."""
    x = torch.tensor([1.0, 0.0, -0.5, 2.0])
    n = 40000
    pos = torch.arange(n, dtype=torch.int64)
    zeros = torch.zeros_like(pos)
    words = reference.philox4x32([zeros, zeros, pos, zeros], (1234, 0))
    picks = torch.argmax(x + reference.neg_log_exponential(torch.stack(words, 1)), dim=1)
    freq = torch.bincount(picks, minlength=4).double() / n
    p = torch.softmax(x.double(), 0)
    assert torch.all((freq - p).abs() < 4 * torch.sqrt(p * (1 - p) / n)), (freq, p)


def test_noise_is_finite_at_the_extreme_words() -> None:
    """The largest and smallest random words map strictly inside (0, 1): no infinite score."""
    noise = reference.neg_log_exponential(torch.tensor([0, 0xFFFFFFFF, 0x80000000]))
    assert torch.isfinite(noise).all()
    assert noise[1] > 16 and noise[0] < -2.7


def test_reference_top_p_draws_from_the_renormalised_nucleus() -> None:
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    logits = probs.log().expand(3000, -1).contiguous()
    rows = [row(seed=7, output=[0] * i, temperature=1.0, top_p=0.8) for i in range(3000)]
    tokens, _, _ = run_reference(logits, rows)
    freq = torch.bincount(tokens, minlength=5).double() / 3000
    want = torch.tensor([0.5, 0.25, 0.15, 0, 0], dtype=torch.float64) / 0.9
    assert freq[3] == 0 and freq[4] == 0
    assert torch.all((freq - want).abs() < 4 * torch.sqrt(want * (1 - want) / 3000) + 1e-9), freq


def test_pack_sampling_rows_layout() -> None:
    rows = [row(temperature=0),
            row(prompt=[5, 5, 6], output=[6, 7, 7], eos=[2], seed=3, index=1, temperature=0.5, top_k=-1,
                repetition_penalty=1.1, logit_bias={9: 1.5}, min_tokens=4, stop_token_ids=[8])]
    packed = kernels.pack_sampling_rows(rows)
    assert packed["params_f32"][1].tolist() == pytest.approx([0.5, 1.0, 0.0, 1.1, 0.0, 0.0])
    top_k, seed, position = packed["params_i64"][1].tolist()
    assert top_k == 0 and position == 3 and seed == kernels.sampling.sequence_seed(3, 1)
    assert packed["bias_offsets"].tolist() == [0, 0, 3]
    assert packed["bias_tokens"].tolist() == [9, 8, 2]
    assert packed["bias_values"].tolist() == [1.5, -math.inf, -math.inf]
    assert packed["penalty_offsets"].tolist() == [0, 0, 3]
    assert dict(zip(packed["penalty_tokens"].tolist(), packed["penalty_counts"].tolist())) == {5: 0, 6: 1, 7: 2}


def test_sample_custom_op_passes_opcheck() -> None:
    torch.manual_seed(5)
    packed = kernels.pack_sampling_rows(mixed_rows(30)[:3])
    args = (torch.randn(3, 30), packed["params_f32"], packed["params_i64"], packed["bias_offsets"],
            packed["bias_tokens"], packed["bias_values"], packed["penalty_offsets"], packed["penalty_tokens"],
            packed["penalty_counts"], True)
    torch.library.opcheck(torch.ops.wllm.sample.default, args)


# ------------------------------------------------------------------------------------------
# CUDA kernel vs reference (GPU machine)
# ------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("vocab", [1000, 32003, 151936])
def test_sample_cuda_matches_reference(vocab: int) -> None:
    torch.manual_seed(6)
    rows = mixed_rows(vocab) * 2
    logits = (torch.randn(len(rows), vocab, device="cuda") * 4)
    before = logits.clone()
    want_tok, want_lp, want_raw = run_reference(logits, rows, return_logprobs=True)
    tok, lp, raw = kernels.sample(logits, **kernels.pack_sampling_rows(rows, "cuda"), return_logprobs=True)
    torch.cuda.synchronize()
    for i, r in enumerate(rows):
        assert tok[i].item() == want_tok[i].item(), f"row {i}: {r.params}"
    torch.testing.assert_close(lp, want_lp, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(raw, want_raw, rtol=1e-5, atol=1e-4)
    assert torch.equal(logits, before), "logits must be restored"
    cpu = Sampler()(before, rows)
    for i, r in enumerate(rows):
        if r.params.greedy:
            assert tok[i].item() == cpu[i].token_id, f"greedy row {i} differs from the CPU sampler"


@pytest.mark.cuda
def test_sample_cuda_batch_independent_and_reproducible() -> None:
    torch.manual_seed(7)
    vocab = 50000
    target = row(seed=99, output=[1, 2, 3], temperature=1.1, top_k=100, top_p=0.9)
    logits = torch.randn(16, vocab, device="cuda")
    alone, _, _ = kernels.sample(logits[5:6].clone(), **kernels.pack_sampling_rows([target], "cuda"))
    others = [row(seed=s, temperature=0.9, top_p=0.5) for s in range(15)]
    batch_rows = others[:5] + [target] + others[5:]
    batch, _, _ = kernels.sample(logits, **kernels.pack_sampling_rows(batch_rows, "cuda"))
    again, _, _ = kernels.sample(logits, **kernels.pack_sampling_rows(batch_rows, "cuda"))
    assert alone[0].item() == batch[5].item()
    assert torch.equal(batch, again)


@pytest.mark.cuda
def test_sample_cuda_distribution() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04], device="cuda")
    n = 8192
    logits = probs.log().expand(n, -1).contiguous()
    rows = [row(seed=5, output=[0] * i, temperature=1.0, top_p=0.85) for i in range(n)]
    tok, _, _ = kernels.sample(logits, **kernels.pack_sampling_rows(rows, "cuda"))
    freq = torch.bincount(tok, minlength=5).double().cpu() / n
    want = torch.tensor([0.4, 0.3, 0.2, 0.0, 0.0], dtype=torch.float64) / 0.9
    assert freq[3] == 0 and freq[4] == 0
    assert torch.all((freq - want).abs() < 4 * torch.sqrt(want * (1 - want) / n) + 1e-9), freq


@pytest.mark.cuda
def test_sample_inside_cuda_graph() -> None:
    torch.manual_seed(8)
    vocab, rows = 32000, mixed_rows(32000)
    packed = kernels.pack_sampling_rows(rows, "cuda")
    logits = torch.randn(len(rows), vocab, device="cuda")

    def step():
        return kernels.sample(logits, **packed, return_logprobs=False)

    graph, (tok, lp, _) = capture_graph(step)
    for trial in range(3):
        logits.copy_(torch.randn_like(logits) * 3)
        packed["params_i64"][:, 2] += 1  # next position
        want_tok, want_lp, _ = reference.sample(logits, **packed)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(tok, want_tok), f"replay {trial}"
        torch.testing.assert_close(lp, want_lp, rtol=1e-5, atol=1e-4)


# ------------------------------------------------------------------------------------------
# Edge cases: reference against naive expectations (CPU), kernel against reference (-m cuda)
# ------------------------------------------------------------------------------------------


def edge_case(kind: str, vocab: int, rows: int, device: str = "cpu") -> tuple[torch.Tensor, list[SamplingRow]]:
    """Logits and rows of one edge case, `rows` rows of `vocab` logits (seeded, reproducible)."""
    g = torch.Generator().manual_seed(vocab * 131 + rows)
    logits = torch.randn(rows, vocab, generator=g) * 3
    params: dict = {"temperature": 0.9}
    if kind == "ties":  # few distinct values, many tokens each: thresholds fall inside runs of ties
        logits = torch.randint(-3, 3, (rows, vocab), generator=g).float()
        params = {"temperature": 1.0, "top_k": max(1, vocab // 3), "top_p": 0.6}
    elif kind == "neg_inf":  # most tokens banned, some rows entirely
        logits = logits.masked_fill(torch.rand(rows, vocab, generator=g) < 0.9, float("-inf"))
        logits[::3] = float("-inf")
        params = {"temperature": 1.0, "top_p": 0.9}
    elif kind == "top_k_1":
        params = {"temperature": 1.5, "top_k": 1}
    elif kind == "top_p_tiny":
        params = {"temperature": 1.0, "top_p": 1e-6}
    elif kind == "min_p":
        params = {"temperature": 0.7, "min_p": 0.2}
    elif kind == "greedy":
        params = {"temperature": 0.0}
    rs = [row(seed=1000 + i, output=[0] * (i % 5), **params) for i in range(rows)]
    return logits.to(device), rs


EDGE_KINDS = ["ties", "neg_inf", "top_k_1", "top_p_tiny", "min_p", "greedy", "plain"]


@pytest.mark.parametrize("kind", EDGE_KINDS)
def test_reference_edge_cases_match_naive_expectations(kind: str) -> None:
    logits, rows = edge_case(kind, 33, 9)
    tokens, _, _ = run_reference(logits, rows)
    for i, r in enumerate(rows):
        x = logits[i]
        if kind in ("top_k_1", "top_p_tiny", "greedy"):
            # One survivor: the (first) maximum; top_p keeps every logit tied with it.
            if kind == "top_p_tiny":
                assert x[tokens[i]] == x.max(), f"row {i}"
            else:
                assert tokens[i].item() == int(torch.argmax(x)), f"row {i}"
        elif kind == "neg_inf":
            if torch.isinf(x).all():
                assert tokens[i].item() == 0, f"row {i}: an all -inf row gives token 0 like argmax"
            else:
                assert x[tokens[i]] > float("-inf"), f"row {i}: a banned token was drawn"
        elif kind == "min_p":
            xt = x / 0.7
            assert torch.exp(xt[tokens[i]] - xt.max()) >= 0.2, f"row {i}"
        elif kind == "ties":
            keep = reference.sampling_mask(x, r.params.top_k, r.params.top_p, 0.0)
            assert keep[tokens[i]], f"row {i}"
            # Ties are kept or dropped together.
            assert torch.equal(keep, x >= x[keep].min()), f"row {i}"


def _cuda_vs_reference(logits: torch.Tensor, rows: list[SamplingRow], what: str) -> torch.Tensor:
    before = logits.clone()
    want_tok, want_lp, _ = run_reference(logits, rows)
    tok, lp, _ = kernels.sample(logits, **kernels.pack_sampling_rows(rows, "cuda"))
    torch.cuda.synchronize()
    assert torch.equal(tok.cpu(), want_tok.cpu()), f"{what}: rows {(tok != want_tok).nonzero().flatten().tolist()}"
    finite = torch.isfinite(want_lp)
    torch.testing.assert_close(lp[finite], want_lp[finite], rtol=1e-5, atol=1e-4)
    assert torch.equal(logits, before), f"{what}: logits must be restored"
    return tok


@pytest.mark.cuda
@pytest.mark.parametrize("vocab", [1, 33, 1000, 151936])
@pytest.mark.parametrize("rows", [1, 3, 70])
def test_sample_cuda_odd_sizes_and_edge_cases(vocab: int, rows: int) -> None:
    """Every edge case at odd vocabularies and row counts: 1 row (many blocks per row), 3 and 70 rows."""
    for kind in EDGE_KINDS:
        logits, rs = edge_case(kind, vocab, rows, "cuda")
        _cuda_vs_reference(logits, rs, f"{kind} vocab={vocab} rows={rows}")


@pytest.mark.cuda
@pytest.mark.parametrize("vocab", [1000, 151936])
def test_sample_cuda_mixed_rows_with_unaligned_rows(vocab: int) -> None:
    """Bias, bans and penalties on rows that start off 16-byte alignment (a strided view), 1 to 13 rows."""
    torch.manual_seed(9)
    for n in (1, 2, 13):
        rows = (mixed_rows(vocab) * 2)[:n]
        base = torch.randn(n, vocab + 3, device="cuda") * 4
        logits = base[:, 1:vocab + 1]
        _cuda_vs_reference(logits, rows, f"unaligned n={n}")


@pytest.mark.cuda
def test_sample_cuda_same_token_for_any_batch_and_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """A seeded row draws the same token alone (many blocks on its row), in batches of 7, 70 and 200
    (fewer blocks per row, then one) and without a workspace (one block per row)."""
    torch.manual_seed(10)
    vocab = 151936
    target_logits = torch.randn(1, vocab, device="cuda") * 2
    targets = [row(seed=77, output=[1, 2], temperature=t, top_k=k, top_p=p, min_p=mp)
               for t, k, p, mp in [(1.0, 0, 1.0, 0.0), (0.8, 0, 0.95, 0.0), (0.8, 50, 0.95, 0.0), (1.2, 0, 0.9, 0.05)]]
    for target in targets:
        alone = _cuda_vs_reference(target_logits.clone(), [target], "alone")[0].item()
        for batch in (7, 70, 200):
            logits = torch.randn(batch, vocab, device="cuda") * 2
            logits[batch // 2] = target_logits[0]
            rows = [row(seed=s, temperature=0.9, top_p=0.9) for s in range(batch)]
            rows[batch // 2] = target
            tok, _, _ = kernels.sample(logits, **kernels.pack_sampling_rows(rows, "cuda"))
            assert tok[batch // 2].item() == alone, f"batch {batch}: {target.params}"
        monkeypatch.setattr(kernels.sampling, "persistent_workspace", lambda *args: None)
        one_block, _, _ = kernels.sample(target_logits.clone(), **kernels.pack_sampling_rows([target], "cuda"))
        monkeypatch.undo()
        assert one_block[0].item() == alone, f"one block per row: {target.params}"


@pytest.mark.cuda
@pytest.mark.parametrize("batch", [1, 5, 64])
def test_sample_cuda_graph_replays_match_reference(batch: int) -> None:
    """Batch-1 and small-batch rows (several blocks per row, workspace counters reset by the last block)
    captured once and replayed with new logits and positions, as the decode graphs do."""
    torch.manual_seed(11)
    vocab = 151936 if batch == 1 else 32003
    base = [row(seed=3, temperature=0.8, top_p=0.95), row(seed=4, temperature=0.0),
            row(seed=5, temperature=0.8, top_k=50, top_p=0.95), row(seed=6, temperature=1.0, min_p=0.1)]
    rows = (base * batch)[:batch]
    packed = kernels.pack_sampling_rows(rows, "cuda")
    logits = torch.randn(batch, vocab, device="cuda")

    def step():
        return kernels.sample(logits, **packed)

    graph, (tok, lp, _) = capture_graph(step)
    for trial in range(5):
        logits.copy_(torch.randn_like(logits) * 3)
        packed["params_i64"][:, 2] += 1
        want_tok, want_lp, _ = reference.sample(logits, **packed)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(tok, want_tok), f"replay {trial}"
        torch.testing.assert_close(lp, want_lp, rtol=1e-5, atol=1e-4)
