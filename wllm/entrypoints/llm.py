"""`wllm.LLM`: offline batch generation in the style of vLLM.

    from wllm import LLM, SamplingParams
    llm = LLM()  # the embedded SmolLM2-135M-Instruct; or LLM("path/to/model.gguf" or an HF folder)
    print(llm.generate("The capital of France is", SamplingParams(max_tokens=8))[0].outputs[0].text)
    print(llm.chat([{"role": "user", "content": "Hi!"}])[0].outputs[0].text)
    llm.close()  # or `with LLM() as llm:`: the GPU memory is free again at once

    embedder = LLM("path/to/all-MiniLM-L6-v2")  # an embed model: its task comes from its files
    vectors = embedder.embed(["a sentence", "another one"])  # one list of floats per text
    scores = embedder.score("a query", ["doc one", "doc two"])  # cosine similarity (a reranker: its score)
    embedder.close()  # or `with LLM() as llm:`: the GPU memory is free again at once
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from wllm.engine.llm_engine import LLMEngine
from wllm.model.pooling import check_dimensions, embed_input, pair_input
from wllm.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from wllm.pooling_params import PoolingParams
from wllm.sampling_params import BeamSearchParams, SamplingParams

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
        task: str = "auto",
        **engine_args: Any,
    ) -> None:
        """`model`: an HF folder or hub id, a GGUF file, or a dummy shape name with
        `load_format="dummy"`; None = the embedded default model. `task`: "auto" (from the model's files),
        "generate", "embed" or "rerank" (see docs/embeddings.md). `engine_args` are engine
        settings (block_size, kv_cache_memory, num_gpu_blocks, max_num_seqs,
        max_num_batched_tokens (default ~8192 on CUDA, in whole GEMM waves: 8448 on an H200; 2048
        elsewhere), max_model_len, device, dtype, seed, ...)."""
        if model is None:
            from wllm.model.default_model import default_model_path

            model = default_model_path()
        self.engine = LLMEngine.from_pretrained(model, tokenizer=tokenizer, load_format=load_format,
                                                revision=revision, task=task, **engine_args)
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

    @property
    def task(self) -> str:
        """What the model serves: "generate", "embed" or "rerank" (`LLM(model, task=...)` to say it)."""
        return self.engine.task

    def embed(self, texts: str | Sequence[int] | Sequence[str | Sequence[int]], *,
              truncate_prompt_tokens: int | None = None, dimensions: int | None = None) -> list[list[float]]:
        """The embedding of each text (or list of token ids), in order, for an embed model. A text longer
        than the model takes is a ValueError with the numbers, unless `truncate_prompt_tokens` (-1: to the
        model's maximum) is given; `dimensions` truncates Matryoshka embeddings."""
        if self.engine.task != "embed":
            raise ValueError(f"embed needs an embed model; this one's task is {self.engine.task}")
        batch = [texts] if isinstance(texts, str) else list(texts)
        if batch and all(isinstance(t, int) for t in batch):
            batch = [batch]  # type: ignore[list-item]
        why = check_dimensions(self.engine.pooling, dimensions)  # type: ignore[arg-type]
        if why is not None:
            raise ValueError(why)
        params = PoolingParams(dimensions=dimensions)
        prompts = [embed_input(self.engine.tokenizer, t, self.engine.max_model_len, truncate_prompt_tokens)
                   for t in batch]  # type: ignore[arg-type]
        return [out.pooled or [] for out in self._run_pooling([(p, params) for p in prompts])]

    def score(self, query: str, documents: str | Sequence[str], *,
              truncate_prompt_tokens: int | None = None) -> list[float]:
        """The relevance of each document to `query`: a rerank model's score of the pair, or for an embed
        model the cosine similarity of their embeddings."""
        docs = [documents] if isinstance(documents, str) else list(documents)
        engine = self.engine
        pooling = engine.pooling
        if pooling is None:
            raise ValueError("score needs an embed or rerank model; this one's task is generate")
        if pooling.pairs_as_one_prompt:
            inputs = [pair_input(engine.tokenizer, pooling, query, d, engine.max_model_len, truncate_prompt_tokens)
                      for d in docs]
            outs = self._run_pooling([(ids, PoolingParams(token_type_start=t)) for ids, t in inputs])
            return [out.pooled[0] for out in outs if out.pooled]
        vectors = self.embed([query, *docs], truncate_prompt_tokens=truncate_prompt_tokens)
        return [cosine(vectors[0], v) for v in vectors[1:]]

    def _run_pooling(self, requests: Sequence[tuple[list[int], PoolingParams]]) -> list[RequestOutput]:
        ids = []
        try:
            for prompt, params in requests:
                rid = f"llm-{next(self._ids)}"
                self.engine.add_request(rid, prompt, params, final_only=True)
                ids.append(rid)
            final: dict[str, RequestOutput] = {}
            while len(final) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        if out.error is not None:
                            raise RuntimeError(f"the engine failed: {out.error}")
                        final[out.request_id] = out
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return [final[rid] for rid in ids]

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search over each prompt (all prompts batched together); returns each prompt's `beam_width` beams,
        best first. Ranking and stopping follow HF transformers' `generate(num_beams=...)`; see
        docs/beam_search.md."""
        sampling = params.to_sampling_params()
        outs = self.generate(prompts, sampling)
        lp = params.length_penalty
        return [BeamSearchOutput(out.prompt_token_ids, [
            BeamSearchSequence(c.text, list(c.token_ids), c.cumulative_logprob or 0.0,
                               (c.cumulative_logprob or 0.0) / max(1, len(c.token_ids)) ** lp, c.finish_reason or "")
            for c in out.outputs]) for out in outs]

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


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity of two vectors (0 when either is all zeros)."""
    import math

    dot = sum(x * y for x, y in zip(a, b))
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na and nb else 0.0
