"""Converted test models of the encoder group (specs.py's notes): bert variants (cased, CLS pooling),
nomic-bert and jina-bert-v2 (remote-code families: their checkpoints written here as the released repos
have them, config.json keys and tensor names), Qwen3-Embedding (last-token pooling) and Qwen3-Reranker
(the converter keeps lm_head's "yes"/"no" rows as cls.output)."""
import json
import math
from pathlib import Path

from specs import BERT, CHATML, SMALL, pooling

# nomic-embed-text-v1.5's config.json (contrastors' NomicBertConfig, remote code); make.py's width
NOMIC = {"activation_function": "swiglu", "architectures": ["NomicBertModel"], "attn_pdrop": 0.0,
         "auto_map": {"AutoConfig": "nomic-ai/nomic-bert-2048--configuration_hf_nomic_bert.NomicBertConfig",
                      "AutoModel": "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertModel"},
         "bos_token_id": None, "causal": False, "dense_seq_output": True, "embd_pdrop": 0.0, "eos_token_id": None,
         "fused_bias_fc": True, "fused_dropout_add_ln": True, "initializer_range": 0.02, "layer_norm_epsilon": 1e-12,
         "max_trained_positions": 2048, "mlp_fc1_bias": False, "mlp_fc2_bias": False, "model_type": "nomic_bert",
         "n_embd": 64, "n_head": 4, "n_inner": 96, "n_layer": 2, "n_positions": 8192, "pad_vocab_size_multiple": 64,
         "parallel_block": False, "parallel_block_tied_norm": False, "prenorm": False, "qkv_proj_bias": False,
         "reorder_and_upcast_attn": False, "resid_pdrop": 0.0, "rotary_emb_base": 1000, "rotary_emb_fraction": 1.0,
         "rotary_emb_interleaved": False, "rotary_emb_scale_base": None, "rotary_scaling_factor": None,
         "scale_attn_by_inverse_layer_idx": False, "scale_attn_weights": True, "summary_activation": None,
         "summary_first_dropout": 0.0, "summary_proj_to_labels": True, "summary_type": "cls_index",
         "summary_use_proj": True, "torch_dtype": "float32", "transformers_version": "4.37.2", "type_vocab_size": 2,
         "use_cache": True, "use_flash_attn": True, "use_rms_norm": False, "use_xentropy": True}

# jina-embeddings-v2-base-en's config.json (jina-bert-implementation's JinaBertConfig, model_type bert):
# ALiBi, GEGLU; 6 heads (base-en has 12), so ALiBi's slopes take both of ggml's branches
JINA = {"architectures": ["JinaBertModel"], "attention_probs_dropout_prob": 0.0, "attn_implementation": "torch",
        "auto_map": {"AutoConfig": "jinaai/jina-bert-implementation--configuration_bert.JinaBertConfig",
                     "AutoModel": "jinaai/jina-bert-implementation--modeling_bert.JinaBertModel",
                     "AutoModelForMaskedLM": "jinaai/jina-bert-implementation--modeling_bert.JinaBertForMaskedLM",
                     "AutoModelForSequenceClassification":
                         "jinaai/jina-bert-implementation--modeling_bert.JinaBertForSequenceClassification"},
        "classifier_dropout": None, "emb_pooler": "mean", "feed_forward_type": "geglu", "gradient_checkpointing": False,
        "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "hidden_size": 48, "initializer_range": 0.02,
        "intermediate_size": 96, "layer_norm_eps": 1e-12, "max_position_embeddings": 8192, "model_max_length": 8192,
        "model_type": "bert", "num_attention_heads": 6, "num_hidden_layers": 2, "pad_token_id": 0,
        "position_embedding_type": "alibi", "torch_dtype": "float32", "transformers_version": "4.26.0",
        "type_vocab_size": 2, "use_cache": True}

QK_SCALE = 3.0  # Q and K projections scaled up: sharper attention, so positions (RoPE, ALiBi) tell in the outputs

QWEN3_TOKENS = dict(specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                    tokens={"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
                    chat_template=CHATML)
QWEN3 = dict(SMALL, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True)  # the 0.6B's tied embeddings


def _finish(d: Path, spec: dict) -> Path:
    """make.py's tail for a written checkpoint: extra files, the spec's notes for convert.py."""
    for fname, text in spec.get("extra_files", {}).items():
        (d / fname).parent.mkdir(parents=True, exist_ok=True)
        (d / fname).write_text(text)
    (d / "hearthlm_spec.json").write_text(json.dumps({"pre": spec.get("pre", "default")}))
    return d


def _nomic(d: Path, spec: dict, n_vocab: int, seed: int) -> Path:
    """transformers 5's NomicBertModel saves contrastors' tensor names (encoder.layers.N.attn.Wqkv,
    mlp.fc11/fc12/fc2, emb_ln); its config.json is replaced by the released one, which the converter reads."""
    import torch
    import transformers
    from make import _randomize
    cfg = transformers.NomicBertConfig(
        vocab_size=n_vocab, hidden_size=NOMIC["n_embd"], num_hidden_layers=NOMIC["n_layer"],
        num_attention_heads=NOMIC["n_head"], intermediate_size=NOMIC["n_inner"], hidden_act="silu",
        layer_norm_eps=NOMIC["layer_norm_epsilon"], type_vocab_size=2, max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": float(NOMIC["rotary_emb_base"])})
    torch.manual_seed(seed)
    model = transformers.NomicBertModel(cfg, add_pooling_layer=False).to(torch.float32)
    _randomize(model, seed)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.q_proj.weight.mul_(QK_SCALE)
            layer.self_attn.k_proj.weight.mul_(QK_SCALE)
    model.save_pretrained(d, safe_serialization=True)
    (d / "config.json").write_text(json.dumps({**NOMIC, "vocab_size": n_vocab}, indent=2))
    return _finish(d, spec)


def _jina_tensors(n_vocab: int) -> dict[str, tuple[int, ...]]:
    """JinaBertModel's parameters (jina-bert-implementation's modeling_bert.py): BERT's, less position
    embeddings (ALiBi), the FFN one GLU (mlp.gated_layers: gate and up halves, no bias; mlp.wo; mlp.layernorm)."""
    e, ff, n = JINA["hidden_size"], JINA["intermediate_size"], JINA["num_hidden_layers"]
    t = {"embeddings.word_embeddings.weight": (n_vocab, e), "embeddings.token_type_embeddings.weight": (2, e),
         "embeddings.LayerNorm.weight": (e,), "embeddings.LayerNorm.bias": (e,),
         "pooler.dense.weight": (e, e), "pooler.dense.bias": (e,)}
    for i in range(n):
        p = f"encoder.layer.{i}."
        for m in ("query", "key", "value"):
            t |= {f"{p}attention.self.{m}.weight": (e, e), f"{p}attention.self.{m}.bias": (e,)}
        t |= {f"{p}attention.output.dense.weight": (e, e), f"{p}attention.output.dense.bias": (e,),
              f"{p}attention.output.LayerNorm.weight": (e,), f"{p}attention.output.LayerNorm.bias": (e,),
              f"{p}mlp.gated_layers.weight": (2 * ff, e), f"{p}mlp.wo.weight": (e, ff), f"{p}mlp.wo.bias": (e,),
              f"{p}mlp.layernorm.weight": (e,), f"{p}mlp.layernorm.bias": (e,)}
    return t


def _jina(d: Path, spec: dict, n_vocab: int, seed: int) -> Path:
    """No transformers class: config.json and model.safetensors written as the released repo has them,
    the weights drawn as make.py's _randomize draws them."""
    import torch
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(_jina_tensors(n_vocab).items()):
        r = torch.randn(shape, generator=g, dtype=torch.float32)
        if len(shape) == 1:
            out[name] = 0.1 * r if name.endswith("bias") else 1.0 + 0.1 * r
        else:
            out[name] = r if "embeddings" in name else r / math.sqrt(shape[-1])
            if name.endswith(("self.query.weight", "self.key.weight")):
                out[name] = QK_SCALE * out[name]
    save_file(out, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps({**JINA, "vocab_size": n_vocab}, indent=2))
    return _finish(d, spec)


def _qwen3_embedding_bpe(d: Path, spec: dict) -> None:
    """Qwen3-Embedding's tokenizer.json: the post-processor appends <|endoftext|> (the token pooled last),
    so the converter writes it as EOS with add_eos_token, <|im_end|> becoming EOT."""
    from make import _bpe
    from tokenizers import Tokenizer, processors
    _bpe(d, spec)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", pair="$A <|endoftext|> $B:1 <|endoftext|>:1",
        special_tokens=[("<|endoftext|>", eot)])
    tok.save(str(d / "tokenizer.json"))


SPECS = {
    # bert-base-cased-style WordPiece: no lowercasing (the converter writes normalizer.lowercase false)
    "bert-cased": dict(config_class="BertConfig", model_class="BertModel", tokenizer="wpm", pre="bert-bge",
                       lowercase=False, config=BERT, extra_files=pooling("mean")),
    # CLS pooling, as bge-*-en-v1.5 ships it
    "bert-cls": dict(config_class="BertConfig", model_class="BertModel", tokenizer="wpm", pre="bert-bge",
                     config=BERT, extra_files=pooling("cls_token")),
    # nomic-embed-text-v1.5: RoPE (base 1000), fused QKV, SwiGLU without biases; bert-base-uncased's WordPiece
    "nomic-bert": dict(tokenizer="wpm", pre="bert-bge", writer=_nomic, extra_files=pooling("mean")),
    # jina-embeddings-v2-base-en: ALiBi, GEGLU in one matrix; its WordPiece (the converter's jina-v2-en)
    "jina-bert-v2": dict(tokenizer="wpm", pre="jina-v2-en", writer=_jina, extra_files=pooling("mean")),
    # Qwen3-Embedding-0.6B: Qwen3ForCausalLM, tied, pooled at the last token (<|endoftext|>, appended)
    "qwen3-embedding": dict(config_class="Qwen3Config", model_class="Qwen3ForCausalLM",
                            tokenizer=_qwen3_embedding_bpe, pre="qwen2", config=QWEN3, **QWEN3_TOKENS,
                            extra_files=pooling("lasttoken")),
    # Qwen3-Reranker-0.6B: the converter knows it by name (this folder's, the README's title) and keeps
    # lm_head's "yes" and "no" rows (whole tokens of its vocabulary) as cls.output; a rerank template
    "qwen3-reranker": dict(config_class="Qwen3Config", model_class="Qwen3ForCausalLM", tokenizer="bpe", pre="qwen2",
                           config=QWEN3, **QWEN3_TOKENS, corpus=["yes\nno\nyes no"] * 16,
                           extra_files={"README.md": "# Qwen3-Reranker-0.6B\n"}),
}
