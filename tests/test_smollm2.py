"""The embedded default model (SmolLM2-135M-Instruct, GGUF Q4_1): wLLM's GGUF load against
HF transformers' own GGUF load of the same file (both dequantize to float32)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import transformers as tf
from model_utils import one_thread

from wllm.model.contiguous_attention import ContiguousAttention, greedy_generate
from wllm.model.default_model import default_model_path
from wllm.model.loader import LoadedModel, load_model
from wllm.model.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

TEXT = (
    "The history of astronomy is a story of patient observation. Long before telescopes, people "
    "in Babylon, Egypt, China and Greece tracked the motions of the Sun, the Moon and the planets, "
    "and used them to keep calendars, plan harvests and predict eclipses. Greek thinkers such as "
    "Aristarchus and Hipparchus measured the sizes and distances of the Moon and the Sun with simple "
    "geometry, and Ptolemy collected centuries of work into a model of nested circles that lasted "
    "for more than a thousand years. In the sixteenth century Copernicus placed the Sun at the "
    "centre, Tycho Brahe made the most precise naked-eye measurements ever taken, and Kepler used "
    "them to show that planets move in ellipses. Galileo turned a telescope to the sky and saw the "
    "moons of Jupiter, the phases of Venus and countless stars in the Milky Way. Newton then "
    "explained all of it with a single law of gravitation, and astronomy became physics."
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with one_thread():
        yield


@pytest.fixture(scope="module")
def ours() -> LoadedModel:
    return load_model(default_model_path(), dtype="float32")


@pytest.fixture(scope="module")
def hf() -> tf.PreTrainedModel:
    # HF's own GGUF path: the config and the dequantized, HF-named tensors come from transformers'
    # GGUF loader. (from_pretrained(gguf_file=...) does the same but insists on `accelerate`.)
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = default_model_path()
    config = tf.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


@torch.no_grad()
def _our_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    ctx = ContiguousAttention()
    ctx.prepare([0], [len(ids)])
    return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), ctx))


@torch.no_grad()
def _hf_greedy(hf: tf.PreTrainedModel, ids: list[int], n: int) -> list[int]:
    # Greedy with HF's KV cache, never stopping at EOS (we compare exactly n tokens).
    past = None
    inp = torch.tensor([ids])
    out: list[int] = []
    for _ in range(n):
        res = hf(inp, cache=past, use_cache=True)
        past = res.cache
        out.append(int(res.logits[0, -1].argmax()))
        inp = torch.tensor([[out[-1]]])
    return out


def test_config_from_gguf(ours: LoadedModel) -> None:
    cfg = ours.config
    assert cfg.architecture == "LlamaForCausalLM" and ours.load_format == "gguf"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        30,
        576,
        9,
        3,
    )
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152


@torch.no_grad()
def test_logits_match_hf_on_long_text(ours: LoadedModel, hf: tf.PreTrainedModel, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    assert 180 <= len(ids) <= 260
    mine = _our_logits(ours.model, ids)
    ref = hf(torch.tensor([ids])).logits[0].float()
    assert (mine - ref).abs().max().item() < 1e-3
    assert torch.equal(mine.argmax(-1), ref.argmax(-1))


def test_greedy_64_tokens_match_hf(ours: LoadedModel, hf: tf.PreTrainedModel, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Once upon a time, in a small village by the sea,")
    assert greedy_generate(ours.model, ids, 64) == _hf_greedy(hf, ids, 64)


@torch.no_grad()
def test_chat_capital_of_france(ours: LoadedModel, hf: tf.PreTrainedModel, tokenizer: Tokenizer) -> None:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    # The first reply token is a near tie between candidates; the logits must agree closely.
    first = _our_logits(ours.model, ids)[-1]
    ref = hf(torch.tensor([ids])).logits[0, -1].float()
    assert (first - ref).abs().max().item() < 1e-3
    reply = tokenizer.decode(greedy_generate(ours.model, ids, 24))
    assert "Paris" in reply, reply
