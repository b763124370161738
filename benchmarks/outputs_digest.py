"""A digest of what a workload's requests produce, to check that two source trees give the same outputs.

Random weights in a real shape (`load_format="dummy"`, seeded), so it runs anywhere; a workload shaped
like traffic rather than one batch: prompts of 5-900 tokens, a shared 300-token prefix on a third of
them, greedy and seeded sampling (top-p, penalties), n = 2, logprobs and prompt logprobs, max_tokens 1-80,
a tiny step budget on a second pass so prompts are chunked. Prints one line per pass with the number of
tokens and a SHA-256 over every request's token ids, finish reasons and rounded logprobs; run it with each
tree on the same machine and compare the lines.

    python benchmarks/outputs_digest.py [--shape qwen2.5-0.5b] [--requests 96] [--device cuda]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from wllm.entrypoints.llm import LLM  # noqa: E402
from wllm.sampling_params import SamplingParams  # noqa: E402


def workload(n: int, vocab: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(10, vocab) for _ in range(300)]
    prompts, params = [], []
    for i in range(n):
        body = [rng.randrange(10, vocab) for _ in range(rng.choice([5, 17, 64, 200, 511, 900]))]
        prompts.append(prefix + body if i % 3 == 0 else body)
        kind = i % 6
        max_tokens = rng.choice([1, 8, 33, 80])
        if kind == 0:
            p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        elif kind == 1:
            p = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=3, ignore_eos=True)
        elif kind == 2:
            p = SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=max_tokens, ignore_eos=True)
        elif kind == 3:
            p = SamplingParams(temperature=0.7, n=2, seed=i, max_tokens=max_tokens, ignore_eos=True)
        elif kind == 4:
            p = SamplingParams(temperature=0.0, repetition_penalty=1.2, max_tokens=max_tokens, ignore_eos=True)
        else:
            p = SamplingParams(temperature=0.0, prompt_logprobs=2, max_tokens=max_tokens, ignore_eos=True)
        params.append(p)
    return prompts, params


def digest(outs: list) -> tuple[int, str]:
    h = hashlib.sha256()
    tokens = 0
    for o in outs:
        for c in o.outputs:
            tokens += len(c.token_ids)
            lps = [round(s.logprob, 2) for s in c.logprobs or []]
            h.update(json.dumps([o.request_id[-4:], c.index, list(c.token_ids), c.finish_reason, lps]).encode())
        if o.prompt_logprobs is not None:
            h.update(json.dumps([None if s is None else s.token_id for s in o.prompt_logprobs]).encode())
    return tokens, h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for label, extra in (("default", {}), ("budget 64", {"max_num_batched_tokens": 64, "max_num_seqs": 16})):
        llm = LLM(args.shape, load_format="dummy", device=args.device, seed=args.seed, max_model_len=2048,
                  gpu_memory_utilization=0.5, **extra)
        vocab = llm.engine.model.config.vocab_size
        prompts, params = workload(args.requests, vocab, args.seed)
        outs = llm.generate(prompts, params)
        tokens, hexdigest = digest(outs)
        print(f"outputs_digest {args.shape} {label}: {len(outs)} requests, {tokens} tokens, sha256 {hexdigest}",
              flush=True)
        llm.close()


if __name__ == "__main__":
    main()
