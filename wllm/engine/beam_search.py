"""One request's beam search: which beams go on after each step, which are set aside as finished, and when
the search is over. The rules are HF transformers' `generate(num_beams=W, do_sample=False)`:

- Each step, every running beam's top K next tokens (K = max(2, 1 + number of EOS ids) x W, by raw
  log-softmax) are candidates, scored by the beam's cumulative logprob plus the token's. The best K of all
  candidates are kept, best first.
- A candidate "hits a stop" when its token is an EOS id or it reaches the length limit. The best W
  candidates that do not become the next running beams (best first).
- Of the first W candidates (by rank), those that hit a stop are finished hypotheses, scored
  cumulative logprob / generated length ** length_penalty (the length counts the EOS token); the best W
  finished hypotheses are kept.
- The search ends when every candidate hits a stop (the length limit), when `early_stopping` is True and
  W hypotheses are finished, or when W are finished and the best running beam cannot beat the worst of them:
  its score divided by the current length ** length_penalty (by the maximum length when `early_stopping` is
  "never" and length_penalty > 0) is no better.

The scheduler (`Scheduler._beam_step`) gives this the running beams' results and turns its answer into
sequences: continuing a beam in place, forking it (shared KV blocks, a copy of the partial last block), or
dropping it.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from wllm.outputs import TokenLogprob
from wllm.sampling_params import SamplingParams


class Hypothesis(msgspec.Struct):
    """A finished beam: its generated tokens (the EOS token included), raw cumulative logprob and score."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (EOS) or "length"


class BeamSearch:
    """The state of one request's beam search between steps (see the module docstring for the rules)."""

    def __init__(self, params: SamplingParams, max_new_tokens: int, eos_token_ids: Sequence[int]) -> None:
        self.width = params.beam_width
        self.length_penalty = params.length_penalty
        self.early_stopping = params.early_stopping
        self.max_new_tokens = max_new_tokens
        self.eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self.num_candidates = max(2, 1 + len(self.eos)) * self.width
        # What the sampler is asked for per beam: the top K raw logprobs (the greedy token is not used).
        self.sampling_params = SamplingParams(temperature=0.0, logprobs=self.num_candidates, max_tokens=None)
        self.num_generated = 0
        self.finished: list[Hypothesis] = []  # best first, at most `width`
        self.improvable = True
        self.done = False
        self.next_index = 1  # sequence index of the next forked beam (index 0 is the prompt's)
        self.pending: dict[str, Sequence[TokenLogprob]] = {}  # seq id -> its candidates of the step under way

    def step(
        self,
        beams: Sequence[tuple[float, Sequence[int], Sequence[TokenLogprob]]],
    ) -> list[tuple[int, int, float]]:
        """Advance by one token. `beams`: per running beam, (its cumulative logprob, its generated tokens, its top
        candidates). Returns the next running beams as (index into `beams`, token, new cumulative logprob), best
        first; an empty list when the search is over (`done`), the results then in `finished`."""
        cands = sorted(
            ((score + t.logprob, b, t.token_id) for b, (score, _, top) in enumerate(beams) for t in top),
            key=lambda c: (-c[0], c[1], c[2]),
        )[: self.num_candidates]
        length = self.num_generated + 1
        at_limit = length >= self.max_new_tokens
        eos = self.eos

        running = [(b, tok, score) for score, b, tok in cands if not (at_limit or tok in eos)][: self.width]
        new = [
            Hypothesis(
                [*beams[b][1], tok], score, score / length**self.length_penalty, "stop" if tok in eos else "length"
            )
            for score, b, tok in cands[: self.width]
            if at_limit or tok in eos
        ]
        if new:
            # Stable: an earlier hypothesis wins a tie, as in transformers' merge (old ones first).
            self.finished = sorted(self.finished + new, key=lambda h: -h.score)[: self.width]
        self.num_generated = length

        full = len(self.finished) == self.width
        if full and running:
            never = self.early_stopping == "never" and self.length_penalty > 0.0
            best_length = self.max_new_tokens if never else length
            best_possible = running[0][2] / best_length**self.length_penalty
            self.improvable = best_possible > self.finished[-1].score
        all_stop = at_limit or all(tok in eos for _, _, tok in cands)
        if not self.improvable or (full and self.early_stopping is True) or all_stop or not running:
            self.done = True
            return []
        return running

    def results(self, n: int) -> list[Hypothesis]:
        """The best `n` finished hypotheses, best first."""
        return self.finished[:n]
