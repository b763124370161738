"""Offline throughput on the CPU: wLLM's engine vs HF transformers' generate, same model, same run.

Model: the embedded SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to float32 by both sides).
Workload: N random prompts of P tokens, each generating exactly O tokens (EOS ignored), greedy.
wLLM runs them through `LLM.generate` (continuous batching, paged KV); HF runs one padded-free
batch through `generate` with its KV cache. Prints a table of prompt and output tokens per second
(tokens / total wall time of the run, as vLLM's offline benchmark reports).

    python benchmarks/offline_cpu.py --num-prompts 16 --prompt-len 128 --output-len 64
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import time
from pathlib import Path

import torch


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _hf_model(path: Path):
    import transformers as tf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = tf.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)
    return model.eval()


def run_wllm(path: Path, prompts: list[list[int]], output_len: int, args: argparse.Namespace) -> float:
    from wllm.entrypoints.llm import LLM
    from wllm.sampling_params import SamplingParams

    llm = LLM(path, dtype="float32", device="cpu", kv_cache_memory=args.kv_cache_memory,
              max_num_batched_tokens=args.max_num_batched_tokens)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return elapsed


@torch.no_grad()
def run_hf(path: Path, prompts: list[list[int]], output_len: int) -> float:
    model = _hf_model(path)
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=2, do_sample=False)  # warm-up
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                         do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + output_len
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from wllm.model.default_model import default_model_path

    path = default_model_path()
    gen = torch.Generator().manual_seed(0)
    # Ids from the ordinary-token range of the 49,152-token vocabulary (the first ids are specials).
    prompts = torch.randint(100, 49000, (args.num_prompts, args.prompt_len), generator=gen).tolist()
    n_prompt = args.num_prompts * args.prompt_len
    n_out = args.num_prompts * args.output_len

    rows = [("wLLM (paged, continuous batching)", run_wllm(path, prompts, args.output_len, args))]
    if not args.skip_hf:
        rows.append(("HF transformers generate (batch)", run_hf(path, prompts, args.output_len)))

    print(f"\nSmolLM2-135M-Instruct float32 on CPU ({platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads), commit {_commit()}, torch {torch.__version__}")
    print(f"{args.num_prompts} prompts x {args.prompt_len} tokens -> {args.output_len} tokens each, greedy\n")
    print(f"| {'engine':<36} | {'wall s':>8} | {'prompt tok/s':>12} | {'output tok/s':>12} | {'vs HF':>6} |")
    print(f"|{'-' * 38}|{'-' * 10}:|{'-' * 14}:|{'-' * 14}:|{'-' * 8}:|")
    hf_time = rows[1][1] if len(rows) > 1 else None
    for name, t in rows:
        ratio = f"{hf_time / t:.2f}x" if hf_time else "-"
        print(f"| {name:<36} | {t:8.2f} | {n_prompt / t:12.1f} | {n_out / t:12.1f} | {ratio:>6} |")


if __name__ == "__main__":
    main()
