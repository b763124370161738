"""`wllm.LLM`: offline batch generation in the style of vLLM.

    from wllm import LLM, SamplingParams
    llm = LLM()  # the embedded SmolLM2-135M-Instruct; or LLM("path/to/model.gguf" or an HF folder)
    print(llm.generate("The capital of France is", SamplingParams(max_tokens=8))[0].outputs[0].text)
    print(llm.chat([{"role": "user", "content": "Hi!"}])[0].outputs[0].text)
    llm.close()  # or `with LLM() as llm:`: the GPU memory is free again at once
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from wllm.engine.llm_engine import LLMEngine
from wllm.outputs import RequestOutput
from wllm.sampling_params import SamplingParams

Prompt = str | Sequence[int] | Mapping[str, Any]
Message = Mapping[str, Any]


class LLM:
    """Load a model once, then run batches of prompts or conversations to completion."""

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        tokenizer: str | os.PathLike[str] | None = None,
        load_format: str = "auto",
        revision: str | None = None,
        **engine_args: Any,
    ) -> None:
        """`model`: an HF folder or hub id, a GGUF file, or a dummy shape name with
        `load_format="dummy"`; None = the embedded default model. `engine_args` are engine
        settings (block_size, kv_cache_memory, num_gpu_blocks, max_num_seqs,
        max_num_batched_tokens (default ~8192 on CUDA, in whole GEMM waves: 8448 on an H200; 2048
        elsewhere), max_model_len, device, dtype, seed, ...)."""
        if model is None:
            from wllm.model.default_model import default_model_path

            model = default_model_path()
        self.engine = LLMEngine.from_pretrained(model, tokenizer=tokenizer, load_format=load_format,
                                                revision=revision, **engine_args)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def close(self) -> None:
        """Free the model's GPU memory (weights, KV cache, CUDA graphs) now; see `LLMEngine.close`.
        Idempotent. `with LLM(...) as llm:` closes on leaving the block."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt; returns one finished RequestOutput per prompt, in order.

        A prompt is a string, a list of token ids, or a dict with "prompt" or "prompt_token_ids".
        A single prompt may be passed without a list.
        """
        batch = _as_batch(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(batch)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(batch):
                raise ValueError(f"got {len(params_list)} SamplingParams for {len(batch)} prompts")
        for grammar in {p.grammar for p in params_list if p.grammar is not None}:
            self.engine.grammar_compiler.compile(grammar)  # a bad grammar raises here, before anything is queued
        ids = []
        try:
            for prompt, params in zip(batch, params_list):
                rid = f"llm-{next(self._ids)}"
                self.engine.add_request(rid, _prompt_input(prompt), params, final_only=True)
                ids.append(rid)
            final: dict[str, RequestOutput] = {}
            while len(final) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
        except BaseException:
            for rid in ids:  # leave the engine clean for the next call (e.g. after Ctrl-C)
                self.engine.abort(rid)
            raise
        return [final[rid] for rid in ids]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of {"role", "content"} dicts) or a list of them, using
        the model's chat template."""
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer, so chat templates cannot be applied")
        conversations: list[Sequence[Message]]
        if messages and isinstance(messages[0], Mapping):
            conversations = [messages]  # type: ignore[list-item]
        else:
            conversations = list(messages)  # type: ignore[arg-type]
        prompts: list[Prompt] = []
        for conv in conversations:
            text = tok.apply_chat_template(list(conv), tools=tools, add_generation_prompt=add_generation_prompt,
                                           chat_template=chat_template)
            # The rendered template already holds BOS and other specials.
            prompts.append(tok.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params)


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # one prompt given as token ids
    return items


def _prompt_input(prompt: Prompt) -> str | Iterable[int]:
    """A prompt as `LLMEngine.add_request` takes it, which checks token ids (integers, in the
    vocabulary) in one pass."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            return prompt["prompt_token_ids"]
        if "prompt" in prompt:
            return str(prompt["prompt"])
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, Iterable):  # a list, tuple, array or tensor of token ids
        return prompt
    raise TypeError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
