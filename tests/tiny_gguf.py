"""Tiny synthetic GGUF models (random weights, byte-level vocab) for fast engine and
architecture tests: one writer for every architecture, as mlx-lm's model_test_runner."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from hearthlm.model_zoo.tokenizer_bpe import _byte_to_unicode

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _vocab() -> tuple[list[str], list[int]]:
    table = _byte_to_unicode()
    tokens = SPECIALS + [table[b] for b in range(256)] + [table[32] + "t"]
    types = [3] * len(SPECIALS) + [1] * 257  # control, then normal
    return tokens, types


def write_tiny(path: Path, arch: str = "llama", *, n_layer: int = 2, n_embd: int = 64, n_head: int = 4,
               n_head_kv: int = 2, n_ff: int = 128, qtype: T = T.Q8_0, seed: int = 0,
               chat_template: str = CHATML, context_length: int = 512, renamed: dict[int, str] | None = None,
               pre: str = "gpt2", merges: tuple[str, ...] = ()) -> Path:
    """`renamed`: token id -> another text (a vocabulary that differs from the others'); `pre`:
    tokenizer.ggml.pre; `merges`: BPE merges beyond the one built in, their tokens appended."""
    rng = np.random.default_rng(seed)
    tokens, types = _vocab()
    for i, text in (renamed or {}).items():
        tokens[i] = text
    merges = [f"{_byte_to_unicode()[32]} t", *merges]
    for m in merges[1:]:
        tokens.append(m.replace(" ", ""))
        types.append(1)
    w = gguf.GGUFWriter(str(path), arch)
    head_dim = n_embd // n_head
    w.add_block_count(n_layer)
    w.add_context_length(context_length)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    if arch == "gemma3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(8)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(chat_template)

    def mat(name, rows, cols, scale=None):
        x = rng.standard_normal((rows, cols)).astype(np.float32) * (scale or 1 / np.sqrt(cols))
        data = gguf.quants.quantize(x, qtype) if qtype != T.F32 else x
        w.add_tensor(name, data, raw_dtype=qtype)

    def vec(name, n, base=1.0):
        w.add_tensor(name, (base + 0.1 * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", len(tokens), n_embd, scale=1.0)
    vec("output_norm.weight", n_embd)
    for il in range(n_layer):
        p = f"blk.{il}."
        vec(p + "attn_norm.weight", n_embd)
        mat(p + "attn_q.weight", n_head * head_dim, n_embd)
        mat(p + "attn_k.weight", n_head_kv * head_dim, n_embd)
        mat(p + "attn_v.weight", n_head_kv * head_dim, n_embd)
        mat(p + "attn_output.weight", n_embd, n_head * head_dim)
        vec(p + "ffn_norm.weight", n_embd)
        mat(p + "ffn_gate.weight", n_ff, n_embd)
        mat(p + "ffn_up.weight", n_ff, n_embd)
        mat(p + "ffn_down.weight", n_embd, n_ff)
        if arch == "gemma3":
            vec(p + "attn_q_norm.weight", head_dim)
            vec(p + "attn_k_norm.weight", head_dim)
            vec(p + "post_attention_norm.weight", n_embd)
            vec(p + "post_ffw_norm.weight", n_embd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
