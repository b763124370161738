"""`wllm generate "PROMPT"`: answer one prompt from the command line, streaming the text.

The default model is the embedded SmolLM2-135M-Instruct; the prompt is wrapped in the model's
chat template unless `--no-chat` is given.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from wllm.model.loader.presets import DUMMY_QUANTIZATIONS


def register(subparsers: Any) -> None:
    """Add the `generate` subcommand to the `wllm` parser."""
    p = subparsers.add_parser("generate", help="generate text for one prompt (default model: SmolLM2-135M)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", help="the prompt text ('-' reads it from stdin)")
    p.add_argument("--model", "-m", default=None,
                   help="HF folder or hub id, or a .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    p.add_argument("--quantization", default=None, choices=DUMMY_QUANTIZATIONS,
                   help="with --load-format dummy: random GGUF blocks of this preset (q4_k_m, q8_0, ...)")
    p.add_argument("--no-chat", action="store_true", help="complete the raw prompt; no chat template")
    p.add_argument("--system", default=None, help="a system message (chat mode)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=256 << 20, help="KV cache bytes on the CPU")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: run every step eagerly (no CUDA graphs)")
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   help="CUDA: finish each decode step on the host before launching the next")
    p.add_argument("--no-stream", action="store_true", help="print the answer only when it is complete")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from wllm.engine.llm_engine import LLMEngine
    from wllm.model.loader import ModelLoadError
    from wllm.sampling_params import SamplingParams

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    model = args.model
    if model is None:
        from wllm.model.default_model import DefaultModelError, default_model_path

        try:
            model = default_model_path()
        except DefaultModelError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens, stop=args.stop)
    try:
        params.validate()
        engine = LLMEngine.from_pretrained(model, load_format=args.load_format, quantization=args.quantization,
                                           device=args.device,
                                           dtype=args.dtype, max_model_len=args.max_model_len,
                                           kv_cache_memory=args.kv_cache_memory, max_num_seqs=1,
                                           enforce_eager=args.enforce_eager,
                                           async_scheduling=args.async_scheduling)
        tok = engine.tokenizer
        if args.no_chat or tok is None:
            engine.add_request("cli", prompt, params)
        else:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            messages.append({"role": "user", "content": prompt})
            text = tok.apply_chat_template(messages, add_generation_prompt=True)
            engine.add_request("cli", tok.encode(text, add_special_tokens=False), params)
    except (ModelLoadError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    shown = ""
    final = None
    try:
        while engine.has_unfinished():
            for out in engine.step():
                if out.error:
                    print(f"\nerror: {out.error}", file=sys.stderr)
                    return 1
                text = out.outputs[0].text
                if not args.no_stream and text.startswith(shown):
                    sys.stdout.write(text[len(shown):])
                    sys.stdout.flush()
                    shown = text
                final = out
    except KeyboardInterrupt:
        engine.abort("cli")
        print("", file=sys.stderr)
        return 130
    if args.no_stream and final is not None:
        sys.stdout.write(final.outputs[0].text)
    sys.stdout.write("\n")
    return 0
