"""A synthetic tokenizer for `--load-format dummy` models, so random-weight servers and benchmarks
need no tokenizer files (nothing can be downloaded on benchmark machines).

Byte-level: the first 256 ids are the bytes, so any text encodes (one token per byte) and any
output decodes; the ids up to the model's vocabulary size are filler tokens that decode to
`<tN>`; the last id is `<|endoftext|>` (EOS). The chat template is ChatML.
"""

from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

from wllm.model.tokenizer.tokenizer import Tokenizer

EOS_TEXT = "<|endoftext|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def synthetic_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level tokenizer with exactly `vocab_size` ids (at least 257)."""
    if vocab_size < 257:
        raise ValueError(f"a synthetic tokenizer needs a vocabulary of at least 257 ids, got {vocab_size}")
    byte_of = _gpt2_byte_chars()
    assert set(byte_of) == set(ByteLevel.alphabet())
    vocab = {sym: b for sym, b in byte_of.items()}
    for i in range(256, vocab_size - 1):
        vocab[f"<t{i}>"] = i
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([EOS_TEXT])
    eos = backend.token_to_id(EOS_TEXT)
    assert eos == vocab_size - 1, (eos, vocab_size)
    return Tokenizer(backend, eos_token_id=eos, eos_token_ids=[eos], add_bos_token=False, add_eos_token=False,
                     chat_template=CHATML_TEMPLATE, source=f"<synthetic byte-level tokenizer, {vocab_size} ids>")


def _gpt2_byte_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable bytes map to themselves, the rest to chr(256 + n)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table
