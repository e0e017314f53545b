"""Tiny random-weight encoders (bert, nomic-bert, jina-bert-v2) with a small WordPiece vocabulary,
written as llama.cpp's converter writes them: word-initial pieces with a leading U+2581,
continuations bare, [CLS]/[SEP]/[UNK]/[PAD]/[MASK] as control tokens. The tensors are what the
architecture reads (model_zoo.tensors.specs); a reranker variant adds the classification head."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import models
import numpy as np

from hearthlm.model_zoo.models import get_architecture
from hearthlm.model_zoo.tensors import specs as tensor_specs

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["the", "a", "is", "of", "and", "to", "in", "it", "hearth", "home", "fire", "warm", "cold", "house",
         "search", "query", "document", "vector", "cafe", "naive", "hello", "world", "un", "aff", "able",
         "run", "walk", "talk", "model", "text", "The", "Hello", "Cafe", "World", "café", "naïve"]
PIECES = ["ing", "ed", "s", "er", "ly", "able", "ford", "##x"]  # continuations; "##x": a vocab.txt "####x"
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789") + list(".,!?;:'\"()-[]{}$%&*+/<=>@^_`|~#") + \
    ["中", "文", "字", "日", "本", "語", "é", "ï"]
HP = {"block_count": 2, "context_length": 512, "embedding_length": 32, "feed_forward_length": 64,
      "attention.head_count": 4, "attention.layer_norm_epsilon": 1e-12, "attention.causal": False}


def vocab(n: int = 0) -> list[str]:
    """The tiny vocabulary, padded to n tokens (a real model's size, for benchmarks)."""
    toks = list(SPECIALS) + ["\u2581" + w for w in WORDS] + PIECES
    toks += ["\u2581" + c for c in CHARS] + [c for c in CHARS if c not in toks]
    toks = list(dict.fromkeys(toks))
    return toks + [f"[unused{i}]" for i in range(n - len(toks))]


# name -> (architecture, pooling_type, lowercase, reranker head)
VARIANTS = {
    "bert": ("bert", 1, True, False),
    "bert-cls": ("bert", 2, True, False),
    "bert-cased": ("bert", 1, False, False),
    "bert-reranker": ("bert", 4, True, True),
    "nomic-bert": ("nomic-bert", 1, True, False),
    "jina-bert-v2": ("jina-bert-v2", 1, True, False),            # ALiBi; ffn_up holds GEGLU's two halves
    "jina-bert-v2-reranker": ("jina-bert-v2", 4, True, True),    # ffn_gate apart, Q/K norms, attn_norm_2
    "gemma-embedding": ("gemma-embedding", 1, None, False),  # Gemma's layers: the decoder writer's vocab
    "qwen3-embedding": ("qwen3", 3, None, False),             # a decoder pooled at its last token
    "qwen3-reranker": ("qwen3", 4, None, True),               # its yes/no head on the last token, softmaxed
}
# the decoder writer's models (tests/parity/models.py): hyperparameters and keys llama.cpp reads
DECODER_ENCODERS = {
    "gemma-embedding": ({"block_count": 6, "attention.sliding_window_pattern": 3},
                        {"pooling_type": 1, "dense_2_feat_in": 64, "dense_2_feat_out": 96, "dense_3_feat_in": 96,
                         "dense_3_feat_out": 64}),
    "qwen3-embedding": ({}, {"pooling_type": 3}),
    "qwen3-reranker": ({}, {"pooling_type": 4, "classifier.output_labels": ["yes", "no"]}),
}
HEADS = {"qwen3-reranker": "cls.output.weight"}  # a (2, n_embd) head, as the converter takes lm_head's two rows
# jina-bert-v2: 6 heads, so ALiBi's slopes take both of ggml's branches (4 heads of m0, 2 of m1)
JINA_HP = {"embedding_length": 48, "attention.head_count": 6}
JINA_NORMS = ("attn_q_norm", "attn_k_norm", "attn_norm_2")  # optional: the reranker variant has them


# Benchmarks (`make bench-embed`): all-MiniLM-L6-v2's and bge-small-en-v1.5's shapes, random weights
BENCH = {
    "minilm-l6": {"block_count": 6, "embedding_length": 384, "feed_forward_length": 1536, "attention.head_count": 12},
    "bge-small": {"block_count": 12, "embedding_length": 384, "feed_forward_length": 1536, "attention.head_count": 12},
}
BENCH_VOCAB = 30522


def write(path: Path, variant: str, seed: int = 0, *, bench: str | None = None, qtype=None,
          drop: str | None = None) -> Path:
    """`bench`: a BENCH shape (a bert of BENCH_VOCAB tokens, mean pooling), its matrices in `qtype`;
    `drop`: a tensor left out (bad input)."""
    if bench is not None:
        return _write_bert(path, "bert", 1, True, False, seed, hp={**HP, **BENCH[bench]}, n_vocab=BENCH_VOCAB,
                           qtype=qtype)
    arch, pooling, lowercase, rerank = VARIANTS[variant]
    if variant in DECODER_ENCODERS:
        hp, md = DECODER_ENCODERS[variant]
        extra = {HEADS[variant]: np.random.default_rng(seed + 1).standard_normal((2, 64)) / 8} if variant in HEADS else {}
        return models.write(path, (arch, hp, extra), seed, metadata=md)
    if arch == "jina-bert-v2":
        return _write_bert(path, arch, pooling, lowercase, rerank, seed, hp={**HP, **JINA_HP}, drop=drop,
                           layout=_jina_layout(split_gate=rerank, norms=rerank))
    return _write_bert(path, arch, pooling, lowercase, rerank, seed, drop=drop)


def _jina_layout(*, split_gate: bool, norms: bool):
    """jina-bert-v2's specs (ffn_up of gate | up halves) as a file has them: without the optional
    Q/K and second norms, or (an older converter) with ffn_gate and ffn_up apart."""
    def layout(specs):
        out = []
        for s in specs:
            if not norms and any(f".{n}." in s.name for n in JINA_NORMS):
                continue
            if split_gate and ".ffn_up." in s.name:
                half = (s.shape[0] // 2, *s.shape[1:])
                if s.name.endswith(".weight"):
                    out.append(dataclasses.replace(s, name=s.name.replace("ffn_up", "ffn_gate"), shape=half))
                s = dataclasses.replace(s, shape=half)
            out.append(s)
        return out
    return layout


def _write_bert(path: Path, arch: str, pooling: int, lowercase: bool, rerank: bool, seed: int, *, hp=HP,
                n_vocab: int = 0, qtype=None, drop: str | None = None, layout=None) -> Path:
    rng = np.random.default_rng(seed)
    toks = vocab(n_vocab)
    md = {f"{arch}.{k}": v for k, v in hp.items()}
    md[f"{arch}.pooling_type"] = pooling
    md["tokenizer.ggml.token_type_count"] = 2
    if arch == "nomic-bert":
        md[f"{arch}.rope.freq_base"] = 1000.0
    mod = get_architecture(arch)
    cfg = mod.Config.from_gguf(md, arch)
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in md.items():
        models._add(w, k, v)
    w.add_tokenizer_model("bert")
    if arch == "jina-bert-v2":  # jina-embeddings-v2-*-en's; llama.cpp ignores pre for WordPiece
        w.add_tokenizer_pre("jina-v2-en")
    w.add_token_list(toks)
    w.add_token_types([3 if t in SPECIALS else 1 for t in toks])
    w.add_bos_token_id(toks.index("[CLS]"))
    w.add_uint32("tokenizer.ggml.seperator_token_id", toks.index("[SEP]"))
    w.add_unk_token_id(toks.index("[UNK]"))
    w.add_pad_token_id(toks.index("[PAD]"))
    w.add_mask_token_id(toks.index("[MASK]"))
    w.add_bool("tokenizer.ggml.normalizer.lowercase", lowercase)
    if rerank:
        w.add_array(f"{arch}.classifier.output_labels", ["LABEL_0"])
    specs = tensor_specs(mod, cfg, len(toks))
    for s in (layout(specs) if layout else specs):
        if (s.name.startswith("cls.") and not rerank) or s.name == drop:
            continue
        if len(s.shape) == 1:  # norms ~1, biases ~0
            data = (0.0 if s.name.endswith(".bias") else 1.0) + 0.1 * rng.standard_normal(s.shape)
        else:
            data = rng.standard_normal(s.shape) / np.sqrt(s.shape[-1])
        models.add_tensor(w, s.name, data, None if s.name == "token_types.weight" else qtype)  # added: kept float
    return models.finish(w, path)


TEXTS = [
    "The hearth is warm.",
    "hello world",
    "Hello, World! Café naïve unaffable; running (walked) talks...",
    "search the document vector: query 42 in 中文 and 日本語字",
    "a",
    "the house of the fire is cold and the home is warm and it is a model of text to search in",
    "x##x $5 & 10% <tag> @user #1 ~ok~",
]
QUERY = "warm hearth"
DOCS = ["the hearth is warm", "a cold house", "search the vector", "warm fire in the home"]
