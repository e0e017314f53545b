"""Converted test models of the Gemma family (specs.py's notes): Gemma 2, Gemma 3, EmbeddingGemma and Gemma 4
(E2B-like, and the 31B-like shape whose full layers have their own K/V head count). Each sets the family's
distinctive features as the released configs do; windows are shrunk so that the test's short texts reach them."""
import json

# Gemma's SentencePiece vocabulary: <pad> 0, <eos> 1, <bos> 2, <unk> 3, <mask> and the turn markers next
GEMMA_SPM = dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, dummy_prefix=False,
                 spm_args=dict(pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>"),
                 tokenizer_class="GemmaTokenizer")


def _gemma_tokens(turns: tuple[str, ...]) -> dict:
    """The tokenizer_config.json entries of a Gemma repo: the specials and turn markers as special added tokens
    (the converter makes them CONTROL), BOS added, EOS not."""
    names = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", *turns]
    decoder = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                        "special": True} for i, t in enumerate(names)}
    return dict(user_symbols=["<mask>", *turns],
                tokens={"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>",
                        "mask_token": "<mask>",
                        "added_tokens_decoder": decoder})


GEMMA3_TOKENS = dict(GEMMA_SPM, **_gemma_tokens(("<start_of_turn>", "<end_of_turn>")),
                     chat_template=("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
                                    "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                                    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"))
# Gemma 4: the same pieces as a tokenizer.json (a BPE with byte fallback; the converter's LlamaHfVocab), its turns
GEMMA4_TOKENS = dict(GEMMA_SPM, **_gemma_tokens(("<|turn>", "<turn|>")),
                     chat_template=("{{ bos_token }}{% for m in messages %}<|turn>{{ m['role'] }}\n"
                                    "{{ m['content'] }}<turn|>\n{% endfor %}"
                                    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"))

# Gemma 3 4B's vision markers: in the SentencePiece model as user symbols (7, 8, 9 after the turn markers), special
# added tokens as the released tokenizer has them; mtmd wraps an image in <start_of_image> ... <end_of_image>
GEMMA3_VISION_TOKENS = dict(GEMMA_SPM, **_gemma_tokens(("<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                                                        "<end_of_image>", "<image_soft_token>")),
                            chat_template=GEMMA3_TOKENS["chat_template"])
GEMMA3_VISION_TOKENS["tokens"].update(boi_token="<start_of_image>", eoi_token="<end_of_image>",
                                      image_token="<image_soft_token>")


def _gemma3_processor(image_size: int, n_tokens: int) -> dict[str, str]:
    """Gemma 3's image processor files (the converter reads image_mean/std, and image_seq_length for the pooling:
    (image_size / patch_size) / sqrt(image_seq_length), written only when not llama.cpp's default 4)."""
    pre = {"image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
           "do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
           "image_std": [0.5, 0.5, 0.5], "image_seq_length": n_tokens, "resample": 2,
           "rescale_factor": 1 / 255, "size": {"height": image_size, "width": image_size}}
    return {"preprocessor_config.json": json.dumps(pre, indent=1),
            "processor_config.json": json.dumps({"image_seq_length": n_tokens, "processor_class": "Gemma3Processor"})}


GEMMA = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=512, rms_norm_eps=1e-6, query_pre_attn_scalar=16, tie_word_embeddings=True,
             pad_token_id=0, eos_token_id=1, bos_token_id=2)
# 6-layer shapes (a full-attention layer after five sliding ones) at width 32: the files stay small
GEMMA6 = dict(GEMMA, hidden_size=32, intermediate_size=64, num_hidden_layers=6)


def _dense(n_in: int, n_out: int, seed: int):
    """A sentence-transformers Dense module's weights (linear.weight, no bias), as model.safetensors bytes."""
    def make() -> bytes:
        import torch
        from safetensors.torch import save
        g = torch.Generator().manual_seed(seed)
        return save({"linear.weight": torch.randn((n_out, n_in), generator=g) / n_in ** 0.5})
    return make


def _embedding_gemma_modules(e: int, wide: int) -> dict:
    """EmbeddingGemma's sentence-transformers modules: mean pooling, then Dense e -> wide -> e (no bias,
    identity activation), then Normalize."""
    kinds = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Dense", "Dense"), ("3_Dense", "Dense"),
             ("4_Normalize", "Normalize")]
    modules = [{"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{k}"}
               for i, (p, k) in enumerate(kinds)]
    dense = lambda i, o: json.dumps({"in_features": i, "out_features": o, "bias": False,  # noqa: E731
                                     "activation_function": "torch.nn.modules.linear.Identity"})
    return {"modules.json": json.dumps(modules),
            "1_Pooling/config.json": json.dumps({"word_embedding_dimension": e, "pooling_mode_cls_token": False,
                                                 "pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}),
            "2_Dense/config.json": dense(e, wide), "2_Dense/model.safetensors": _dense(e, wide, 2),
            "3_Dense/config.json": dense(wide, e), "3_Dense/model.safetensors": _dense(wide, e, 3),
            "4_Normalize/config.json": "{}"}


# Gemma 4 E2B: sliding layers of head 16 with default RoPE (base 10000), full ones of head 32 with proportional
# RoPE (a quarter of the dims rotate, base 1e6); per-layer inputs; the last layers read earlier ones' K/V and have
# double-wide MLPs; a final logit soft-cap. E2B: 35 layers, pattern 4 sliding + 1 full, 20 shared.
GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}
GEMMA4 = dict(hidden_size=32, intermediate_size=32, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
              global_head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6, sliding_window=4,
              rope_parameters=GEMMA4_ROPE, final_logit_softcapping=30.0, tie_word_embeddings=True,
              pad_token_id=0, eos_token_id=1, bos_token_id=2)

SPECS = {
    # Gemma 2 2B/9B: sliding (even) and full layers alternating, attention-logit and final-logit soft-capping,
    # query_pre_attn_scalar = head_dim, RoPE base 10000; 6 layers at width 32 (at 64 every token predicts itself)
    "gemma2": dict(config_class="Gemma2Config", model_class="Gemma2ForCausalLM", tokenizer="spm",
                   config=dict(GEMMA6, sliding_window=4, attn_logit_softcapping=50.0,
                               final_logit_softcapping=30.0, rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 10000.0}),
                   **GEMMA3_TOKENS),
    # Gemma 3 4B/12B/27B: five sliding layers (local RoPE base 10000) then a full one (base 1e6, linear 8x)
    "gemma3": dict(config_class="Gemma3TextConfig", model_class="Gemma3ForCausalLM", tokenizer="spm",
                   config=dict(GEMMA6, sliding_window=4, rope_parameters={
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                       "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}),
                   **GEMMA3_TOKENS),
    # Gemma 3 27B's depth (62 layers), where llama.cpp scales attention by (n_embd / n_head)^-1/2 (its
    # query_pre_attn_scalar, 168, not head_dim 128): width 32 over 2 heads of 8, so the two differ
    "gemma3-27b": dict(config_class="Gemma3TextConfig", model_class="Gemma3ForCausalLM", tokenizer="spm",
                       config=dict(GEMMA, hidden_size=32, intermediate_size=8, num_hidden_layers=62,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=16,
                                   sliding_window=4,
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                    "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                       "rope_theta": 1e6}}),
                       **GEMMA3_TOKENS),
    # Gemma 3 4B's vision-language shape (#39): the tiny gemma3 text model under Gemma3ForConditionalGeneration
    # with a SigLIP tower (width 64, 2 layers, 4 heads, patch 4 on 64x64: 16x16 patches, average-pooled 4x4
    # into 16 image tokens); convert_args_mmproj: a second converter pass writes the mmproj file
    "gemma3-vision": dict(config_class="Gemma3Config", model_class="Gemma3ForConditionalGeneration", tokenizer="spm",
                          config=dict(text_config=dict(GEMMA6, sliding_window=4, rope_parameters={
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}),
                              vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                 num_attention_heads=4, image_size=64, patch_size=4,
                                                 layer_norm_eps=1e-6, vision_use_head=False),
                              mm_tokens_per_image=16, boi_token_index=7, eoi_token_index=8, image_token_index=9,
                              tie_word_embeddings=True),
                          extra_files=_gemma3_processor(64, 16), convert_args_mmproj=["--mmproj"],
                          saved_names=[("vision_tower.", "vision_tower.vision_model.")],  # google/gemma-3-4b-it's
                          **GEMMA3_VISION_TOKENS),
    # EmbeddingGemma-300M: Gemma 3 attending both ways (use_bidirectional_attention), mean pooling and the
    # sentence-transformers Dense projections (converted with --sentence-transformers-dense-modules)
    "gemma-embedding": dict(config_class="Gemma3TextConfig", model_class="Gemma3TextModel", tokenizer="spm",
                            config=dict(GEMMA6, sliding_window=8, use_bidirectional_attention=True,
                                        rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 10000.0},
                                                         "full_attention": {"rope_type": "default",
                                                                            "rope_theta": 1e6}}),
                            extra_files=_embedding_gemma_modules(32, 128),
                            convert_args=["--sentence-transformers-dense-modules"], **GEMMA3_TOKENS),
    # Gemma 4 E2B-like: 6 layers (sliding x2, full, sliding x2, full), the last 3 sharing K/V (one full, two
    # sliding), double-wide MLPs there, per-layer inputs of 8
    "gemma4": dict(config_class="Gemma4TextConfig", model_class="Gemma4ForCausalLM", tokenizer="spm_bpe",
                   config=dict(GEMMA4, num_hidden_layers=6, layer_types=["sliding_attention"] * 2 + ["full_attention"]
                               + ["sliding_attention"] * 2 + ["full_attention"], num_kv_shared_layers=3,
                               use_double_wide_mlp=True, hidden_size_per_layer_input=8,
                               vocab_size_per_layer_input=384),  # the vocabulary's size (make.py's 384)
                   **GEMMA4_TOKENS),
    # Gemma 4 31B-like: full layers with their own K/V head count (num_global_key_value_heads: the converter
    # writes head_count_kv per layer) and K as V (attention_k_eq_v: no v_proj there); no per-layer inputs
    "gemma4-kv-heads": dict(config_class="Gemma4TextConfig", model_class="Gemma4ForCausalLM", tokenizer="spm_bpe",
                            config=dict(GEMMA4, num_hidden_layers=4, num_key_value_heads=2,
                                        num_global_key_value_heads=1, attention_k_eq_v=True,
                                        layer_types=["sliding_attention", "full_attention"] * 2,
                                        hidden_size_per_layer_input=0, num_kv_shared_layers=0),
                            **GEMMA4_TOKENS),
    # Gemma 4 26B-A4B-like (30 layers, 128 experts, top 8): the kv-heads layout plus, in every layer, a router
    # (its input RMS-normed, times a learned scale), fused gate/up experts with per-expert output scales beside
    # the dense MLP (the shared expert), each branch with its own norms; 8 experts, top 2, 16 wide
    "gemma4-moe": dict(config_class="Gemma4TextConfig", model_class="Gemma4ForCausalLM", tokenizer="spm_bpe",
                       config=dict(GEMMA4, num_hidden_layers=4, num_key_value_heads=2,
                                   num_global_key_value_heads=1, attention_k_eq_v=True,
                                   layer_types=["sliding_attention", "full_attention"] * 2,
                                   hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                                   enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=16),
                       **GEMMA4_TOKENS),
    # Gemma 4's assistant (gemma-4-*-assistant) for the "gemma4" model above (its backbone_hidden_size): two
    # layers of width 16 that keep no K/V (they read the target's last sliding and full layers'), so their head
    # sizes and K/V head count are the target's; the target's embeddings and hidden state in, its own LM head out
    "gemma4-assistant": dict(config_class="Gemma4AssistantConfig", model_class="Gemma4AssistantForCausalLM",
                             tokenizer="spm_bpe", config=dict(backbone_hidden_size=32, text_config=dict(
                                 GEMMA4, hidden_size=16, num_hidden_layers=2, hidden_size_per_layer_input=0,
                                 layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=2, vocab_size_per_layer_input=0,
                                 final_logit_softcapping=None)),
                             folder="drafts", **GEMMA4_TOKENS),
}
# the same made for a target of another width (48): refused by the 32-wide "gemma4" (tests/test_draft_heads.py)
SPECS["gemma4-assistant-wide"] = dict(SPECS["gemma4-assistant"], config=dict(SPECS["gemma4-assistant"]["config"],
                                                                             backbone_hidden_size=48))
