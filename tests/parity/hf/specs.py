"""One entry a converted test model (this file's SPECS, then each specs_<group>.py's): the
transformers classes, a tiny config, the tokenizer kind
(make.py's bpe / spm / wpm) and, for BPE, the pre-tokenizer name of the real family (convert.py).
Shapes: 2+ layers, width 64, 4 heads of 16 over 2 K/V heads, unless the family needs more."""
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML_TOKENS = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}

BERT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=512, layer_norm_eps=1e-12)


def pooling(mode: str) -> dict[str, str]:
    """sentence-transformers' modules.json and pooling config (the converter reads the pooling type there)."""
    import json
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    return {"modules.json": json.dumps(modules), "1_Pooling/config.json": json.dumps({f"pooling_mode_{m}": m == mode
            for m in ("cls_token", "mean_tokens", "lasttoken")} | {"pooling_mode_mean_tokens": mode == "mean"})}


SPECS = {
    # Llama 2's SentencePiece vocabulary (the converter's sentencepiece path)
    "llama": dict(config_class="LlamaConfig", model_class="LlamaForCausalLM", tokenizer="spm",
                  config=dict(SMALL, rope_theta=10000.0, tie_word_embeddings=False),
                  tokens={"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
    "qwen2": dict(config_class="Qwen2Config", model_class="Qwen2ForCausalLM", tokenizer="bpe", pre="qwen2",
                  config=dict(SMALL, rope_theta=1e6, tie_word_embeddings=True), tokens=CHATML_TOKENS,
                  chat_template=CHATML),
    # BERT with the post-processor `[CLS] $A [SEP]`: the converter writes add_eos_token = true (#37);
    # sentence-transformers' mean pooling, as bge / MiniLM repos ship it
    "bert": dict(config_class="BertConfig", model_class="BertModel", tokenizer="wpm", pre="bert-bge",
                 config=BERT, extra_files=pooling("mean")),
    # a cross-encoder (ms-marco-MiniLM style): one label, ranked on [CLS] q [SEP] d [SEP]
    "bert-reranker": dict(config_class="BertConfig", model_class="BertForSequenceClassification", tokenizer="wpm",
                          pre="bert-bge", config=dict(BERT, num_labels=1)),
}


def _groups() -> None:
    """specs_<group>.py files add their families' entries (one file per group of architectures)."""
    import importlib
    from pathlib import Path
    for f in sorted(Path(__file__).parent.glob("specs_*.py")):
        SPECS.update(importlib.import_module(f.stem).SPECS)


_groups()
