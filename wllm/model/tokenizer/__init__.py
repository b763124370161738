"""Tokenizers (Hugging Face folders and GGUF vocabularies), incremental detokenization, chat templates."""

from wllm.model.tokenizer.chat_template import (
    ChatTemplateError,
    compile_chat_template,
    load_chat_template,
    render_chat_template,
)
from wllm.model.tokenizer.detokenizer import IncrementalDetokenizer
from wllm.model.tokenizer.gguf_vocab import GGUFTokenizerError, GGUFVocab, build_gguf_tokenizer, read_gguf_vocab
from wllm.model.tokenizer.tokenizer import Tokenizer, TokenizerLoadError

__all__ = [
    "ChatTemplateError",
    "GGUFTokenizerError",
    "GGUFVocab",
    "IncrementalDetokenizer",
    "Tokenizer",
    "TokenizerLoadError",
    "build_gguf_tokenizer",
    "compile_chat_template",
    "load_chat_template",
    "read_gguf_vocab",
    "render_chat_template",
]
