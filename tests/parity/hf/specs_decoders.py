"""Converted test models of the decoder families (specs.py's notes): Qwen3 (dense and MoE), SmolLM3, OLMo 2/3,
Phi-3 (and its LongRoPE), Ministral 3, gpt-oss. Each sets its family's distinctive features as the released
configs do; windows and original contexts are shrunk so that the test's short texts (n_ctx 256) reach them."""
from specs import CHATML, CHATML_TOKENS, SMALL

QWEN3_TOKENS = dict(specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
                    tokens=CHATML_TOKENS, chat_template=CHATML)
# SmolLM3: Llama 3's tokenizer and ChatML turns
SMOLLM3_TOKENS = dict(specials=["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"],
                      tokens={"bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"})
# OLMo 2/3: dolma2's cl100k vocabulary (the converter's hash names it dbrx), <|endoftext|> both ends
OLMO_TOKENS = dict(specials=["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"],
                   tokens={"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|pad|>"})
OLMO2 = dict(SMALL, num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=500000.0, tie_word_embeddings=False,
             bos_token_id=0, eos_token_id=0, pad_token_id=1)
# Phi-3's SentencePiece vocabulary (Llama 2's), Phi-3-mini-4k's config: no GQA, a sliding_window llama.cpp ignores
PHI3 = dict(SMALL, num_key_value_heads=4, rope_theta=10000.0, original_max_position_embeddings=512,
            sliding_window=16, tie_word_embeddings=False, bos_token_id=1, eos_token_id=3, pad_token_id=3)
# Phi-3's chat tokens are special added tokens (CONTROL in the file; llama.cpp rstrips them for a model named phi3)
PHI3_CHAT = ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>"]
PHI3_TOKENS = dict(user_symbols=PHI3_CHAT, tokens={
    "bos_token": "<s>", "eos_token": "<|endoftext|>", "unk_token": "<unk>", "pad_token": "<|endoftext|>",
    "added_tokens_decoder": {str(3 + i): {"content": t, "special": True} for i, t in enumerate(PHI3_CHAT)}})
# Phi-3-mini-128k's LongRoPE: per-dimension long/short divisors (head 16: 8 each), the long ones past
# original_max_position_embeddings (128 here, so the test's n_ctx 256 takes them)
LONG = [1.0, 1.2, 1.7, 2.6, 4.1, 6.3, 9.5, 13.9]
SHORT = [1.0, 1.0, 1.05, 1.1, 1.2, 1.3, 1.45, 1.6]
# Ministral 3 (3B/8B/14B 2512): YaRN 16x with mscale_all_dim and Llama 4's attention temperature
# (llama_4_scaling_beta) past original_max_position_embeddings (16 here, so the texts' later positions reach it)
MINISTRAL3_ROPE = {"type": "yarn", "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                   "original_max_position_embeddings": 16, "max_position_embeddings": 256, "beta_fast": 32.0,
                   "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}
TEKKEN_TOKENS = dict(specials=["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
                     tokens={"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
                     tokenizer_config={"add_bos_token": True, "add_eos_token": False})
# gpt-oss: o200k_harmony's specials (the converter's hash names the family gpt-4o)
HARMONY_TOKENS = dict(specials=["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|start|>", "<|message|>",
                                "<|end|>", "<|channel|>", "<|call|>"],
                      tokens={"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"})

SPECS = {
    # Qwen3-8B: per-head Q/K RMSNorms, no biases, an untied head
    "qwen3": dict(config_class="Qwen3Config", model_class="Qwen3ForCausalLM", tokenizer="bpe", pre="qwen2",
                  config=dict(SMALL, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False), **QWEN3_TOKENS),
    # Qwen3-30B-A3B: every layer sparse, top-k weights renormalized (norm_topk_prob)
    "qwen3moe": dict(config_class="Qwen3MoeConfig", model_class="Qwen3MoeForCausalLM", tokenizer="bpe", pre="qwen2",
                     config=dict(SMALL, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]), **QWEN3_TOKENS),
    # SmolLM3-3B: NoPE on every 4th layer (no_rope_layers from no_rope_layer_interval 4), tied embeddings
    "smollm3": dict(config_class="SmolLM3Config", model_class="SmolLM3ForCausalLM", tokenizer="bpe", pre="llama-bpe",
                    config=dict(SMALL, num_hidden_layers=4, rope_theta=5e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                no_rope_layer_interval=4, bos_token_id=0, eos_token_id=3, pad_token_id=3),
                    **SMOLLM3_TOKENS),
    # OLMo-2-1124-7B: post-norms, Q/K norms over all heads, no sliding window
    "olmo2": dict(config_class="Olmo2Config", model_class="Olmo2ForCausalLM", tokenizer="bpe", pre="dbrx",
                  config=OLMO2, **OLMO_TOKENS),
    # Olmo-3-1025-7B: sliding layers (three of each four) with plain RoPE, full layers with YaRN (8x from 8192)
    "olmo3": dict(config_class="Olmo3Config", model_class="Olmo3ForCausalLM", tokenizer="bpe", pre="dbrx",
                  config=dict(OLMO2, num_hidden_layers=4, sliding_window=8, max_position_embeddings=512,
                              rope_parameters={  # as transformers 5 saves Olmo 3's rope_scaling
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
                                  "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0,
                                                     "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                                     "beta_slow": 1.0, "attention_factor": 1.2079441541679836}}),
                  **OLMO_TOKENS),
    "phi3": dict(config_class="Phi3Config", model_class="Phi3ForCausalLM", tokenizer="spm", config=PHI3, **PHI3_TOKENS),
    "phi3-longrope": dict(config_class="Phi3Config", model_class="Phi3ForCausalLM", tokenizer="spm", **PHI3_TOKENS,
                          config=dict(PHI3, original_max_position_embeddings=128, sliding_window=None,
                                      rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                       "long_factor": LONG, "short_factor": SHORT})),
    # Ministral 3's text model (the converter's "mistral3" for Ministral3ForCausalLM), tekken's BPE, tied as the 3B
    "mistral3": dict(config_class="Ministral3Config", model_class="Ministral3ForCausalLM", tokenizer="bpe",
                     pre="tekken", config=dict(SMALL, max_position_embeddings=256, rope_parameters=MINISTRAL3_ROPE,
                                               tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                                               pad_token_id=None), **TEKKEN_TOKENS),
    # gpt-oss-20b: sliding (128, here 8) and full layers alternating, sinks, biases everywhere, 4 of 32 experts
    # (here 2 of 4), YaRN 32x from 4096 (here 16); bf16-style unquantized experts (the converter splits gate_up)
    "gpt-oss": dict(config_class="GptOssConfig", model_class="GptOssForCausalLM", tokenizer="bpe", pre="gpt-4o",
                    config=dict(SMALL, intermediate_size=32, sliding_window=8,
                                max_position_embeddings=512, num_local_experts=4, num_experts_per_tok=2,
                                attention_bias=True, tie_word_embeddings=False, bos_token_id=0, eos_token_id=2,
                                pad_token_id=1,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                                 "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                 "original_max_position_embeddings": 16}),
                    **HARMONY_TOKENS),
}
