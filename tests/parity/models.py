"""Tiny random-weight GGUFs for every registered architecture (mlx-lm's model_test_runner):
one generic set of hyperparameters under the architecture's own prefix, the tensors and
shapes the architecture itself reads (`model_zoo.tensors.specs`), llama.cpp's names as
they are, F32 weights scaled so the next-token distribution is peaked. Variants add what
a model family carries on top (RoPE scaling kinds)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
from gguf.constants import GGMLQuantizationType as T

from hearthlm.backends.random_blocks import random_blocks
from hearthlm.model_zoo.models import ARCHITECTURES, get_architecture
from hearthlm.model_zoo.tensors import Spec
from hearthlm.model_zoo.tensors import specs as tensor_specs
from hearthlm.model_zoo.tokenizer_bpe import _byte_to_unicode

N_VOCAB = 260  # 3 specials + 256 bytes + one merge
TIED = 0.2     # a tied embedding: peaked enough, yet not so large that each token predicts itself
PEAK = 8.0     # LM-head scale: logits ~N(0, 8), the top token well above the next
HPARAMS = {  # every architecture reads what it needs of these
    "block_count": 2, "context_length": 512, "embedding_length": 64, "feed_forward_length": 96,
    "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 16,
    "attention.value_length": 16, "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 10000.0,
    "rope.dimension_count": 16, "attention.sliding_window": 6, "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0, "expert_count": 4, "expert_used_count": 2,
    "expert_feed_forward_length": 32, "shortconv.l_cache": 3,
}
QWEN35 = {"block_count": 6, "full_attention_interval": 3, "rope.dimension_count": 8,
          "rope.dimension_sections": [2, 1, 1, 0], "ssm.conv_kernel": 4, "ssm.inner_size": 64,
          "ssm.state_size": 16, "ssm.time_step_rank": 4, "ssm.group_count": 2}
GRANITE_H = {"block_count": 6, "attention.head_count_kv": [0, 0, 2, 0, 0, 2], "ssm.conv_kernel": 4,
             "ssm.inner_size": 128, "ssm.state_size": 16, "ssm.time_step_rank": 8, "ssm.group_count": 2,
             "embedding_scale": 1.5, "residual_scale": 0.7, "logit_scale": 1.25, "attention.scale": 0.3}
VARIANTS = {  # name -> (architecture, extra metadata, extra F32 tensors by name -> values)
    **{a: (a, {}, {}) for a in ARCHITECTURES  # encoders: encoders.py; draft heads (an assistant): test_draft_heads
       if get_architecture(a).Config.CAUSAL and not hasattr(get_architecture(a), "bind")},
    # hybrids: several layers of each kind, so that the layer pattern matters
    "lfm2": ("lfm2", {"block_count": 6, "attention.head_count_kv": [0, 0, 2, 0, 2, 0]}, {}),
    "lfm2moe": ("lfm2moe", {"block_count": 6, "attention.head_count_kv": [0, 0, 2, 0, 2, 0],
                            "leading_dense_block_count": 2, "expert_gating_func": 2}, {}),
    # 2 key heads for 4 value heads (the delta rule's GQA), partial RoPE (8 of 16 dims)
    "qwen35": ("qwen35", QWEN35, {}),
    "qwen35moe": ("qwen35moe", {**QWEN35, "expert_shared_feed_forward_length": 48}, {}),
    # Qwen3-VL's text model: interleaved M-RoPE sections (text positions: plain RoPE), a deepstack layer (no images)
    "qwen3vl": ("qwen3vl", {"rope.dimension_sections": [3, 3, 2, 0], "n_deepstack_layers": 1}, {}),
    "qwen3vlmoe": ("qwen3vlmoe", {"rope.dimension_sections": [3, 3, 2, 0], "n_deepstack_layers": 1}, {}),  # its experts
    # Qwen2-VL / Qwen2.5-VL's text model: qwen2 with M-RoPE sections in runs (text positions: plain RoPE)
    "qwen2vl": ("qwen2vl", {"rope.dimension_sections": [2, 3, 3, 0]}, {}),
    # Mamba-2 with 8 heads in 2 groups, Granite's multipliers; dense with NoPE attention, MoE + shared expert with RoPE
    "granitehybrid": ("granitehybrid", {**GRANITE_H, "expert_count": None, "expert_used_count": None,
                                        "rope.scaling.finetuned": False}, {}),  # NoPE, as Granite 4.0-H
    "granitehybrid-moe": ("granitehybrid", {**GRANITE_H, "expert_shared_feed_forward_length": 48}, {}),
    # a NoPE layer (every fourth); OLMo 3's sliding layers (all but every fourth) and OLMo 2 without
    "smollm3": ("smollm3", {"block_count": 4}, {}),
    "olmo2": ("olmo2", {"block_count": 4}, {}),
    "olmo2-no-swa": ("olmo2", {"attention.sliding_window": None}, {}),
    # YaRN with the file's ramp bounds and log multiplier; the attention temperature from position 8 on
    "mistral3": ("mistral3", {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                              "rope.scaling.original_context_length": 8, "rope.scaling.yarn_log_multiplier": 1.0,
                              "rope.scaling.yarn_beta_fast": 16.0, "rope.scaling.yarn_beta_slow": 2.0,
                              "attention.temperature_scale": 0.5}, {}),
    # Phi-4-mini's shape: partial rotary (12 of 16 dims), the LM head tied (None: the tensor left out)
    "phi3-phi4mini": ("phi3", {"rope.dimension_count": 12}, {"output.weight": None}),
    # Gemma 4: sliding layers with their own head size and RoPE, full ones with proportional RoPE (half the
    # dimensions rotate: factors of 1e10 stop the rest), the last two layers reading earlier layers' K/V,
    # per-layer inputs, a wider FFN on two layers
    "gemma4": ("gemma4", {"block_count": 6, "attention.sliding_window_pattern": [True, False] * 3,
                          "attention.shared_kv_layers": 2, "attention.key_length": 32, "attention.value_length": 32,
                          "attention.key_length_swa": 16, "attention.value_length_swa": 16,
                          "rope.dimension_count": 32, "rope.dimension_count_swa": 16, "rope.freq_base_swa": 10000.0,
                          "embedding_length_per_layer_input": 32, "feed_forward_length": [96, 96, 96, 96, 192, 192],
                          "expert_count": None},
               {"rope_freqs.weight": np.array([1.0] * 8 + [1e10] * 8)}),
    # Gemma 4 26B-A4B's layout: experts beside the dense FFN in every layer (router scale, fused gate/up, per-expert
    # output scales), full layers with fewer K/V heads and a wider head, no per-layer inputs or shared K/V
    "gemma4-moe": ("gemma4", {"block_count": 4, "attention.sliding_window_pattern": [True, False] * 2,
                              "attention.head_count_kv": [2, 1, 2, 1], "attention.key_length": 32,
                              "attention.value_length": 32, "attention.key_length_swa": 16,
                              "attention.value_length_swa": 16, "rope.dimension_count": 32,
                              "rope.dimension_count_swa": 16, "rope.freq_base_swa": 10000.0,
                              "embedding_length_per_layer_input": 0},  # llama.cpp requires the key
                   {"rope_freqs.weight": np.array([1.0] * 8 + [1e10] * 8)}),
    # sliding (window 4) and full layers alternating, YaRN; attention sinks, router and expert biases
    "gpt-oss": ("gpt-oss", {"block_count": 4, "attention.sliding_window": 4, "rope.scaling.type": "yarn",
                            "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 64}, {}),
    "llama-rope-llama3": ("llama", {}, {"rope_freqs.weight": np.array([4.0, 9.0, 1.0, 1.7, 4.2, 8.0, 8.0, 8.0])}),
    "llama-rope-yarn": ("llama", {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                                  "rope.scaling.original_context_length": 64}, {}),
    "llama-rope-linear": ("llama", {"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}, {}),
    # LongRoPE: the context (256) is past the original one, so the long factors apply
    "phi3-longrope": ("phi3", {"rope.scaling.original_context_length": 128, "rope.scaling.attn_factor": 1.19},
                      {"rope_factors_long.weight": np.array([1.0, 1.5, 2.5, 4.0, 7.0, 11.0, 16.0, 23.0]),
                       "rope_factors_short.weight": np.array([1.0, 1.0, 1.1, 1.2, 1.4, 1.6, 2.0, 2.4])}),
}


def _vocab(w: gguf.GGUFWriter, n_vocab: int = N_VOCAB) -> None:
    """Specials, the 256 bytes, one merge; past N_VOCAB unused tokens (a real model's vocabulary
    size, for the LM head's cost in benchmarks)."""
    table = _byte_to_unicode()
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [table[b] for b in range(256)] + [table[32] + "t"]
    tokens += [f"<|unused_{i}|>" for i in range(n_vocab - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")  # a pre-tokenizer both sides know
    w.add_token_list(tokens)
    w.add_token_types([3] * 3 + [1] * 257 + [5] * (n_vocab - N_VOCAB))
    w.add_token_merges([f"{table[32]} t"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
# llama.cpp settings per variant for its reference run: Gemma 4 attends with scale 1 over RMS-normed Q
# and K (scores up to head_dim), where an f16 K/V cache's rounding moves lower-ranked log-probs by up
# to 0.08 nat in llama.cpp itself: its f32 cache is the exact semantics (ours: f16 on cpu, f32 on reference)
LLAMA_KW = {"gemma4": {"type_k": 0, "type_v": 0}, "gemma4-moe": {"type_k": 0, "type_v": 0}}


def _add(w: gguf.GGUFWriter, key: str, v) -> None:
    if isinstance(v, list):
        w.add_array(key, v)
    elif isinstance(v, bool):
        w.add_bool(key, v)
    elif isinstance(v, str):
        w.add_string(key, v)
    elif isinstance(v, float):
        w.add_float32(key, v)
    else:
        w.add_uint32(key, v)


class _Seen(dict):
    """Metadata that remembers which keys were looked up: what the architecture reads."""

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.seen: set[str] = set()

    def __contains__(self, k) -> bool:
        self.seen.add(k)
        return super().__contains__(k)


def write(path: Path, variant, seed: int = 0, *, defects: dict | None = None,
          qtype: gguf.GGMLQuantizationType | None = None, n_vocab: int = N_VOCAB, qtypes=None,
          metadata: dict | None = None) -> Path:
    """`defects` (bad-input tests): {"metadata": {key: value} written over what the
    architecture reads, "drop": tensor name, "shape": {tensor name: shape}}. `qtype`: matrices
    quantized to it (gguf.quants) instead of F32 (the recorded parity data is F32). `qtypes`
    (benchmarks): `qtypes(name, shape)` -> the tensor's type, written as random blocks, or None: F32.
    `variant`: a name, or an (architecture, metadata, tensors) triple as VARIANTS holds; `metadata`:
    keys written under the architecture's prefix whether it reads them or not (pooling_type)."""
    arch, extra_md, extra_t = (variant if isinstance(variant, tuple) else
                               VARIANTS[variant] if variant in VARIANTS else BENCH[variant])
    d = defects or {}
    rng = np.random.default_rng(seed)
    md = _Seen({f"{arch}.{k}": v for k, v in {**HPARAMS, **extra_md}.items() if v is not None})  # None: absent
    mod = get_architecture(arch)
    cfg = mod.Config.from_gguf(md, arch)
    extra = {**d.get("metadata", {}), **(metadata or {})}
    md.update({f"{arch}.{k}": v for k, v in extra.items()})
    md.seen |= {f"{arch}.{k}" for k in extra}
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in md.items():
        if k in md.seen:  # only the keys the architecture reads (an expert count would make llama MoE)
            _add(w, k, v)
    _vocab(w, n_vocab)
    specs = tensor_specs(mod, cfg, n_vocab)
    names = {s.name for s in specs}
    specs += [Spec(n, np.shape(v)) for n, v in extra_t.items() if n not in names and v is not None]  # RoPE factors: read by Rope.bind
    for s in specs:
        if s.name == d.get("drop") or s.name in extra_t and extra_t[s.name] is None:
            continue
        s = dataclasses.replace(s, shape=tuple(d.get("shape", {}).get(s.name, s.shape)))
        if qtypes and s.optional and s.name.endswith((".bias", "output.weight")):  # benchmarks: tied, no biases
            continue
        bq = qtypes(s.name, s.shape) if qtypes else None
        if bq is not None:
            blocks = random_blocks(bq, int(np.prod(s.shape[:-1])), s.shape[-1], rng)
            w.add_tensor(s.name, blocks.reshape(*s.shape[:-1], -1), raw_dtype=bq)  # 3-D: a stack of experts
            continue
        if s.name in extra_t:
            data = np.asarray(extra_t[s.name], np.float32).reshape(s.shape)
        elif s.name.endswith(".ssm_a"):  # a recurrent layer's A = -exp(A_log): decays, never grows
            data = -np.exp(0.5 * rng.standard_normal(s.shape))
        elif len(s.shape) == 1:  # norms ~1, biases ~0
            data = (0.0 if s.name.endswith(".bias") else 1.0) + 0.1 * rng.standard_normal(s.shape)
        elif s.name == "token_embd.weight" and ("output.weight" not in names or "output.weight" in extra_t):
            data = TIED * rng.standard_normal(s.shape)  # the LM head too (Gemma 2)
        else:  # fan-in scaled; the LM head large enough to peak the logits
            data = (PEAK if s.name == "output.weight" else 1.0) / np.sqrt(s.shape[-1]) * rng.standard_normal(s.shape)
        add_tensor(w, s.name, data, qtype)
    return finish(w, path)


def add_tensor(w: gguf.GGUFWriter, name: str, data, qtype=None) -> None:
    """F32, or the matrices quantized to qtype (gguf.quants)."""
    data = np.ascontiguousarray(data, np.float32)
    if qtype is not None and data.ndim >= 2:
        w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    else:
        w.add_tensor(name, data)


def finish(w: gguf.GGUFWriter, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Benchmarks (`make bench-hybrid`): the real shapes of small hybrids, written with random
# Q4_K_M-like weights (no such file ships on the package index), tied embeddings
BENCH = {
    "qwen35-0.8b": ("qwen35", {"block_count": 24, "context_length": 4096, "embedding_length": 1024,
                               "feed_forward_length": 3584, "attention.head_count": 8, "attention.head_count_kv": 2,
                               "attention.key_length": 256, "attention.value_length": 256,
                               "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1e7,
                               "rope.dimension_count": 64, "rope.dimension_sections": [11, 11, 10, 0],
                               "attention.sliding_window": None, "full_attention_interval": 4,
                               "ssm.conv_kernel": 4, "ssm.inner_size": 2048, "ssm.state_size": 128,
                               "ssm.time_step_rank": 16, "ssm.group_count": 16}, {}),
    "lfm2-350m": ("lfm2", {"block_count": 16, "context_length": 4096, "embedding_length": 1024,
                           "feed_forward_length": 4608, "attention.head_count": 16, "attention.key_length": 64,
                           "attention.value_length": 64, "attention.head_count_kv":
                               [8 if il in (2, 5, 8, 10, 12, 14) else 0 for il in range(16)],
                           "rope.freq_base": 1e6, "rope.dimension_count": 64, "attention.sliding_window": None,
                           "shortconv.l_cache": 3}, {}),
    # Gemma 4 26B-A4B's per-layer shapes (google/gemma-4-26B-A4B-it: width 2816, 16 heads, sliding layers 8 K/V
    # heads of 256, full ones 2 of 512 with K as V, dense FFN 2112, 128 experts of 704, top 8), 6 of its 30 layers
    # (its pattern: 5 sliding, 1 full) so that the file (~3.5 GB at Q4_0, not ~15) fits this host's memory twice
    "gemma4-26b-a4b-6l": ("gemma4", {"block_count": 6, "context_length": 4096, "embedding_length": 2816,
                                     "feed_forward_length": 2112, "attention.head_count": 16,
                                     "attention.head_count_kv": [8] * 5 + [2], "attention.key_length": 512,
                                     "attention.value_length": 512, "attention.key_length_swa": 256,
                                     "attention.value_length_swa": 256, "attention.layer_norm_rms_epsilon": 1e-6,
                                     "rope.freq_base": 1e6, "rope.freq_base_swa": 1e4, "rope.dimension_count": 512,
                                     "rope.dimension_count_swa": 256, "attention.sliding_window": 1024,
                                     "attention.sliding_window_pattern": [True] * 5 + [False],
                                     "attention.shared_kv_layers": 0, "embedding_length_per_layer_input": 0,
                                     "expert_count": 128, "expert_used_count": 8, "expert_feed_forward_length": 704},
                          {"rope_freqs.weight": np.array([1.0] * 64 + [1e30] * 192), "blk.5.attn_v.weight": None}),
    # Gemma 4 E2B's shapes (google/gemma-4-E2B-it: 35 layers, 4 sliding then 1 full, width 1536, 8 heads over 1 K/V
    # head of 256 (full: 512), FFN 6144 (12288 in the 20 layers reading earlier K/V), per-layer inputs of 256: the
    # per_layer_token_embd table is 262,144 x 8,960)
    "gemma4-e2b": ("gemma4", {"block_count": 35, "context_length": 4096, "embedding_length": 1536,
                              "feed_forward_length": [6144] * 15 + [12288] * 20, "attention.head_count": 8,
                              "attention.head_count_kv": 1, "attention.key_length": 512, "attention.value_length": 512,
                              "attention.key_length_swa": 256, "attention.value_length_swa": 256,
                              "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1e6, "rope.freq_base_swa": 1e4,
                              "rope.dimension_count": 512, "rope.dimension_count_swa": 256, "attention.sliding_window": 512,
                              "attention.sliding_window_pattern": ([True] * 4 + [False]) * 7,
                              "attention.shared_kv_layers": 20, "embedding_length_per_layer_input": 256,
                              "expert_count": None, "expert_used_count": None},
                   {"rope_freqs.weight": np.array([1.0] * 64 + [1e30] * 192)}),
}
BENCH_VOCAB = {"qwen35-0.8b": 248320, "lfm2-350m": 65536, "gemma4-26b-a4b-6l": 262144, "gemma4-e2b": 262144}


def q4_0(name: str, shape) -> T | None:
    """Every matrix Q4_0 (the experts' 704 columns are no whole Q4_K super-block)."""
    return T.Q4_0 if len(shape) >= 2 else None


BENCH_QTYPES = {"gemma4-26b-a4b-6l": lambda n_layer: q4_0, "gemma4-e2b": lambda n_layer: q4_0}  # else q4_k_m


def q4_k_m(n_layer: int):
    """llama.cpp's Q4_K_M choice, roughly: Q6_K for the embedding and, in the first and last
    eighth and every third layer between, attn_v and ffn_down; Q4_K for the other matrices;
    vectors and conv kernels F32."""
    def more_bits(il: int) -> bool:
        return il < n_layer // 8 or il >= 7 * n_layer // 8 or (il - n_layer // 8) % 3 == 2

    def pick(name: str, shape) -> T | None:
        if len(shape) < 2 or shape[-1] % 256 or name.endswith(("conv.weight", "conv1d.weight")):
            return None
        if name == "token_embd.weight" or (name.endswith(("attn_v.weight", "ffn_down.weight"))
                                           and more_bits(int(name.split(".")[1]))):
            return T.Q6_K
        return T.Q4_K
    return pick


PROMPTS = [[40, 101, 7, 200, 33, 150], [9, 9, 120, 250, 61, 4, 88, 173, 14, 230, 99]]
N_STEPS = 16
