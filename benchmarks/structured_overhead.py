"""Per-token cost of grammar masking: the same greedy token streams with and without a grammar.

The grammar is a regex every output satisfies (`[\\s\\S]*`), so both variants produce exactly the same
tokens (checked) with the same model work, and the difference is what constrained decoding adds: filling
the masks (llguidance's batched fill in a worker thread, beside the forward), applying them in the sampler
and advancing each sequence's matcher. The variants alternate and the medians of `--repeat` runs are
reported. A second table times the host pieces alone for a JSON-schema matcher in the middle of a string
(the widest masks), per step at each batch size.

    python benchmarks/structured_overhead.py [--batch 1 16] [--tokens 32] [--repeat 3] [--device auto]
                                             [--model PATH]   (default: the embedded SmolLM2-135M-Instruct)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

import torch  # noqa: E402

from wllm.engine.llm_engine import LLMEngine  # noqa: E402
from wllm.engine.sampler import Sampler, SamplingRow  # noqa: E402
from wllm.model.default_model import default_model_path  # noqa: E402
from wllm.sampling_params import SamplingParams  # noqa: E402
from wllm.structured import grammars  # noqa: E402
from wllm.structured.masks import MaskFiller  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper and a storm."


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def end_to_end(engine: LLMEngine, batch: int, tokens: int, repeat: int) -> dict[str, float]:
    """Decode time per output token (a one-token run of the same prompts is subtracted: prefill excluded)."""
    tok = engine.tokenizer
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": f"{PROMPT} ({i})"}]), add_special_tokens=False)
        for i in range(batch)
    ]
    # Not ignore_eos: EOS ends a grammar's matcher (it allows EOS once the text is accepted), so only
    # streams that end at EOS (or the length) are alike.
    permissive = grammars.regex_grammar(r"[\s\S]*")
    variants = {"plain": None, "grammar": permissive}
    run(engine, prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, grammar=permissive))  # warm-up, compile
    times: dict[str, list[float]] = {"plain": [], "grammar": []}
    generated = 0
    for _ in range(repeat):
        for name, grammar in variants.items():
            head, _ = run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=1, grammar=grammar))
            seconds, ids = run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=tokens, grammar=grammar))
            times[name].append(seconds - head)
            if name == "plain":
                want, generated = ids, sum(map(len, ids)) - batch
            elif ids != want:
                raise SystemExit("the permissive grammar changed the tokens: the comparison is not like for like")
    plain_s, grammar_s = statistics.median(times["plain"]), statistics.median(times["grammar"])
    per_token = 1e3 / max(generated, 1)
    return {
        "plain_ms": plain_s * per_token,
        "grammar_ms": grammar_s * per_token,
        "overhead_pct": 100.0 * (grammar_s - plain_s) / plain_s,
        "tokens": generated,
    }


def host_pieces(engine: LLMEngine, batch: int, steps: int = 50) -> dict[str, float]:
    """Microseconds per step for the mask fill, the mask application and the matchers' advance."""
    compiler = engine.grammar_compiler
    schema = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
    compiled = compiler.compile(grammars.json_schema_grammar(schema))
    lt = compiler.ll_tokenizer
    prefix = lt.tokenize_str('{"story": "Once upon a')
    matchers = []
    for _ in range(batch):
        m = compiled.new_matcher()
        assert m.consume_tokens(prefix)
        matchers.append(m)
    filler = MaskFiller(lt.vocab_size)
    vocab = engine.model.config.vocab_size
    logits = torch.randn(batch, vocab)
    rows = [SamplingRow(SamplingParams(temperature=0.0), 0, 0, (1,), [], [0]) for _ in range(batch)]
    sampler = Sampler()
    word = lt.tokenize_str(" time")[0]
    fill = apply = advance = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        masks = filler.start(matchers).wait()
        t1 = time.perf_counter()
        sampler(logits, rows, masks, list(range(batch)))
        t2 = time.perf_counter()
        for m in matchers:
            m.consume_token(word)
        t3 = time.perf_counter()
        for m in matchers:
            m.rollback(1)
        fill += t1 - t0
        apply += t2 - t1
        advance += t3 - t2
    base = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        sampler(logits, rows)
        base += time.perf_counter() - t0
    filler.close()
    scale = 1e6 / steps
    return {
        "fill_us": fill * scale,
        "sample_masked_us": apply * scale,
        "sample_plain_us": base * scale,
        "advance_us": advance * scale,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    engine = LLMEngine.from_pretrained(args.model or default_model_path(), device=args.device, max_model_len=512)
    device = engine.worker.device
    print(f"device {device}, runner {type(engine.worker.runner).__name__}, torch threads {torch.get_num_threads()}")
    print("| batch | decode tokens | ms/token plain | ms/token grammar | overhead |")
    print("|---|---|---|---|---|")
    for b in args.batch:
        r = end_to_end(engine, b, args.tokens, args.repeat)
        print(
            f"| {b} | {r['tokens']} | {r['plain_ms']:.2f} | {r['grammar_ms']:.2f} | {r['overhead_pct']:+.1f}% |",
            flush=True,
        )
    print("\nhost pieces per step, JSON-schema matchers inside a string (microseconds):")
    print("| batch | mask fill | sample masked | sample plain | matchers advance |")
    print("|---|---|---|---|---|")
    for b in args.batch:
        r = host_pieces(engine, b)
        print(
            f"| {b} | {r['fill_us']:.0f} | {r['sample_masked_us']:.0f} | {r['sample_plain_us']:.0f} | "
            f"{r['advance_us']:.0f} |",
            flush=True,
        )
    engine.close()


if __name__ == "__main__":
    main()
