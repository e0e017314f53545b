"""Tiny Hugging Face checkpoints for every supported architecture, made the way users' files are:
transformers builds the model class from a config (its own parameter names and shapes), the weights
are drawn at random and saved as safetensors, and a small tokenizer (BPE, SentencePiece or WordPiece,
trained here on CORPUS) is saved beside them. convert.py then runs llama.cpp's converter on them.
Run under a venv with torch and a transformers that knows every family (never in CI):

    python tests/parity/hf/make.py OUT_DIR [name ...]

Each spec (specs.py) names the transformers class, its config, the tokenizer kind and the BPE
pre-tokenizer name the converter should write."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from specs import SPECS  # noqa: E402

CORPUS = [
    "The hearth is the heart of the home; people gather around the fire to keep warm.",
    "Hello world! Hello, hearth. Models run inside the application, without a server.",
    "A query and a document: search the vector index for the warm house by the sea.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 42 123 2026, and punctuation: (a) [b] {c} <d> e-f g_h.",
    "caf\u00e9 na\u00efve \u4e2d\u6587 \u65e5\u672c\u8a9e \u0431\u043e\u0440\u0449 \U0001F525 tabs\tand  double  spaces\n\nnew lines",
    "def main():\n    return {\"key\": [1, 2, 3]}  # code too",
] * 8
PEAK = 8.0  # LM-head scale: peaked next-token distributions, so greedy steps are not near-ties


def _bpe(out: Path, spec: dict) -> None:
    """A byte-level BPE trained on CORPUS (GPT-2's byte alphabet), the spec's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = spec.get("specials", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    trainer = trainers.BpeTrainer(vocab_size=spec.get("vocab", 384), special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS + spec.get("corpus", []), trainer)  # + a family's own words
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **spec.get("tokens", {}))
    if "chat_template" in spec:
        fast.chat_template = spec["chat_template"]
    fast.save_pretrained(out)
    _tokenizer_class(out, spec.get("tokenizer_class", "PreTrainedTokenizerFast"), spec.get("tokenizer_config", {}))


def _tokenizer_class(out: Path, name: str, extra: dict | None = None) -> None:
    """The class name 4.x transformers know (5.x writes its own "TokenizersBackend"), as real repos have;
    `extra`: the spec's own tokenizer_config.json entries (add_bos_token, which 5.x does not save)."""
    p = out / "tokenizer_config.json"
    p.write_text(json.dumps({**json.loads(p.read_text()), "tokenizer_class": name, **(extra or {})}, indent=1))


def _spm(out: Path, spec: dict) -> None:
    """A SentencePiece BPE with byte fallback (Llama 2 / Gemma style): tokenizer.model."""
    import io

    import sentencepiece as spm
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=buf, vocab_size=spec.get("vocab", 384), model_type="bpe",
        byte_fallback=True, character_coverage=1.0, bos_id=spec.get("bos_id", 1), eos_id=spec.get("eos_id", 2),
        unk_id=spec.get("unk_id", 0), pad_id=spec.get("pad_id", -1), user_defined_symbols=spec.get("user_symbols", []),
        add_dummy_prefix=spec.get("dummy_prefix", True), split_digits=True, minloglevel=2,
        **spec.get("spm_args", {}))  # e.g. Gemma's piece names
    (out / "tokenizer.model").write_bytes(buf.getvalue())
    cfg = {"tokenizer_class": spec.get("tokenizer_class", "LlamaTokenizer"), "add_bos_token": True,
           "add_eos_token": False, **spec.get("tokens", {})}
    if "chat_template" in spec:
        cfg["chat_template"] = spec["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))


def _wpm(out: Path, spec: dict) -> None:
    """A WordPiece vocabulary (BERT's normalizer), saved as BERT repos have it: vocab.txt and
    tokenizer.json with the `[CLS] $A [SEP]` post-processor."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=spec.get("lowercase", True))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    # a fixed vocabulary (tokenizers' WordPiece trainer breaks ties differently run to run): the characters,
    # their continuations, words of up to 5 letters whole and longer ones as a 3-letter head and a "##" rest
    from collections import Counter
    words = Counter(w for line in CORPUS for w, _ in tok.pre_tokenizer.pre_tokenize_str(tok.normalizer.normalize_str(line)))
    pieces = sorted({w[0] for w in words}) + sorted({"##" + c for w in words for c in w[1:]})
    pieces += [p for w in sorted(words) for p in ((w,) if len(w) <= 5 else (w[:3], "##" + w[3:])) if len(w) > 1]
    vocab = list(dict.fromkeys(specials + pieces))[:spec.get("vocab", 384)]
    tok.model = models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]")
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    (out / "vocab.txt").write_text("".join(t + "\n" for t in vocab))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
                                   cls_token="[CLS]", mask_token="[MASK]", do_lower_case=spec.get("lowercase", True))
    fast.save_pretrained(out)
    _tokenizer_class(out, "BertTokenizer")


def _spm_bpe(out: Path, spec: dict) -> None:
    """The SentencePiece vocabulary as a tokenizer.json (a BPE with byte fallback over its pieces, as
    transformers' GemmaTokenizer converts it) and no tokenizer.model: Gemma 4 repos."""
    from transformers import AutoTokenizer
    _spm(out, spec)
    cfg = (out / "tokenizer_config.json").read_text()
    AutoTokenizer.from_pretrained(out).save_pretrained(out)
    (out / "tokenizer.model").unlink()
    (out / "tokenizer_config.json").write_text(cfg)  # _spm's: 5.x writes a list 4.x cannot read (extra_special_tokens)


TOKENIZERS = {"bpe": _bpe, "spm": _spm, "wpm": _wpm, "spm_bpe": _spm_bpe}


def _vocab_size(out: Path) -> int:
    from transformers import AutoTokenizer
    return len(AutoTokenizer.from_pretrained(out))


@torch.no_grad()
def _randomize(model, seed: int) -> None:
    """Fan-in scaled matrices, norms near 1, biases near 0, the LM head scaled to peak the logits
    (transformers' own init, std 0.02, leaves every next token a near-tie)."""
    g = torch.Generator().manual_seed(seed)
    # LFM2-MoE's expert_bias and Gemma 4's layer_scalar are buffers (trained, saved): drawn too, after the parameters
    biases = [(n, b) for n, b in sorted(model.named_buffers()) if n.endswith(("expert_bias", "layer_scalar"))]
    for name, p in sorted(model.named_parameters()) + biases:
        r = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if p.ndim == 1:
            v = (0.1 * r) if name.endswith("bias") else (1.0 + 0.1 * r)
            if name.endswith("expert_bias"):  # a selection bias as wide as the router's logits: it changes picks
                v = r
            if name.endswith("layer_scalar"):  # a layer's output scale: positive, around 1
                v = (0.5 * r).exp()
            if "norm" in name and getattr(model.config, "model_type", "").startswith(("gemma", "qwen3_5")) \
                    and "linear_attn.norm" not in name and "vision_tower" not in name and "visual" not in name \
                    and not model.config.model_type.startswith("gemma4"):  # Gemma 4's norms multiply by weight
                v = 0.1 * r  # these RMSNorms multiply by (1 + weight); the towers' LayerNorms by weight
        elif "embed" in name and "lm_head" not in name and "visual" not in name:  # Qwen's ViT: fan-in scaled
            v = 0.2 * r if getattr(model.config, "tie_word_embeddings", False) else r
        else:
            v = r / math.sqrt(p.shape[-1]) * (PEAK if "lm_head" in name else 1.0)
        p.copy_(v.to(p.dtype))


def make(name: str, out: Path, seed: int = 0) -> Path:
    import transformers
    spec = SPECS[name]
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    tk = spec["tokenizer"]  # a kind, or a spec's own callable (d, spec)
    (tk if callable(tk) else TOKENIZERS[tk])(d, spec)
    n_vocab = _vocab_size(d)
    if "writer" in spec:  # a remote-code family (no transformers class): the spec writes the checkpoint
        return spec["writer"](d, spec, n_vocab, seed)
    cfg_cls = getattr(transformers, spec["config_class"])
    if "text_config" in spec["config"]:  # a multimodal wrapper: the vocabulary is its text half's
        cfg = cfg_cls(**{**spec["config"], "text_config": {**spec["config"]["text_config"], "vocab_size": n_vocab}})
    else:
        cfg = cfg_cls(**{**spec["config"], "vocab_size": n_vocab})
    torch.manual_seed(seed)
    model = getattr(transformers, spec["model_class"])(cfg).to(torch.float32)
    _randomize(model, seed)
    if "adjust" in spec:  # a family's weights rescaled after the draw (Granite's small embeddings, sharper Q/K)
        spec["adjust"](model)
    model.save_pretrained(d, safe_serialization=True)
    if "extra_tensors" in spec:  # tensors the transformers class leaves out (Qwen3.5's MTP block), merged in
        from safetensors.torch import load_file, save_file
        f = d / "model.safetensors"
        extra = spec["extra_tensors"](model, lambda m: _randomize(m, seed + 1))
        save_file({**load_file(f), **extra}, f, metadata={"format": "pt"})
    if "saved_names" in spec:  # the released checkpoint's tensor names where transformers 5 saves others
        from safetensors.torch import load_file, save_file
        f = d / "model.safetensors"
        rename = lambda k: next((new + k[len(old):] for old, new in spec["saved_names"] if k.startswith(old)), k)  # noqa: E731
        save_file({rename(k): v for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    if "saved_layout" in spec:  # the released checkpoint's tensor layout where transformers 5 saves another
        from safetensors.torch import load_file, save_file
        f = d / "model.safetensors"
        save_file({k: spec["saved_layout"](k, v).contiguous() for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    if "saved_config" in spec:  # the released config.json's spelling where transformers 5 renamed a value
        cfg_path = d / "config.json"
        saved = json.loads(cfg_path.read_text())  # a dict value merges into the saved one (text_config)
        saved.update({k: {**saved[k], **v} if isinstance(v, dict) and isinstance(saved.get(k), dict) else v
                      for k, v in spec["saved_config"].items()})
        cfg_path.write_text(json.dumps(saved, indent=2))
    for fname, text in spec.get("extra_files", {}).items():  # sentence-transformers modules and the like
        (d / fname).parent.mkdir(parents=True, exist_ok=True)
        if callable(text):  # binary files (a Dense module's safetensors): made here, under torch
            (d / fname).write_bytes(text())
        else:
            (d / fname).write_text(text)
    keep = {"pre": spec.get("pre", "default"), "convert_args": spec.get("convert_args", [])}
    if "folder" in spec:  # convert.py writes the file there (drafts/: an assistant, which runs on its target)
        keep["folder"] = spec["folder"]
    if "convert_args_mmproj" in spec:  # a vision model: convert.py's second pass writes its mmproj file
        keep["convert_args_mmproj"] = spec["convert_args_mmproj"]
    (d / "hearthlm_spec.json").write_text(json.dumps(keep))
    return d


if __name__ == "__main__":
    out = Path(sys.argv[1])
    for n in sys.argv[2:] or sorted(SPECS):
        print("made", make(n, out))
