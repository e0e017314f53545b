"""Recurrent / attention hybrids and their MoE variants (specs.py's SPECS gathers these): LFM2 short
convolutions, Qwen3.5 Gated DeltaNet, Granite 4.0-H Mamba-2, each interleaved with attention layers
the way the released models lay them out, with several layers of each kind so the pattern matters."""
import json

from specs import CHATML, CHATML_TOKENS

# LFM2: ChatML with <|startoftext|> as BOS (LiquidAI's tokenizer)
LFM2_TOKENS = dict(specials=["<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                   tokens={"bos_token": "<|startoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|pad|>"},
                   chat_template=CHATML)
LFM2 = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            norm_eps=1e-5, conv_L_cache=3, conv_bias=False, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6})
# Qwen3.5: gated attention every full_attention_interval-th layer (partial RoPE over a quarter of the
# head, interleaved M-RoPE sections), Gated DeltaNet elsewhere with fewer key heads than value heads
QWEN35 = dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
              max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
              linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=4, full_attention_interval=3,
              rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                               "mrope_interleaved": True, "mrope_section": [2, 1, 1]})


def qwen35_mtp(model, randomize) -> dict:
    """The multi-token-prediction block the released Qwen3.5 checkpoints carry (mtp.*, which
    transformers leaves out; the converter appends it as a nextn layer): one full-attention decoder
    layer of the model's own class, saved by a one-layer model of it, plus fc and its norms."""
    import copy
    import math
    import tempfile

    import torch
    from safetensors.torch import load_file
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers, cfg.layer_types = 1, ["full_attention"]
    one = type(model)(cfg).to(torch.float32)
    randomize(one)
    with tempfile.TemporaryDirectory() as tmp:
        one.save_pretrained(tmp, safe_serialization=True)
        saved = load_file(f"{tmp}/model.safetensors")
        layer = {k.replace("model.layers.0.", "mtp.layers.0."): v for k, v in saved.items() if k.startswith("model.layers.0.")}
    g, h = torch.Generator().manual_seed(1), cfg.hidden_size
    norms = {f"mtp.{n}.weight": 0.1 * torch.randn(h, generator=g) for n in ("pre_fc_norm_embedding",
                                                                           "pre_fc_norm_hidden", "norm")}
    return {**layer, **norms, "mtp.fc.weight": torch.randn(h, 2 * h, generator=g) / math.sqrt(2 * h)}


MTP = dict(extra_tensors=qwen35_mtp, saved_config={"mtp_num_hidden_layers": 1})


def qwen35_vision_mtp(model, randomize) -> dict:
    """The MTP block of a vision-language checkpoint: its text half's (qwen35_mtp on a text model of its config)."""
    import transformers
    return qwen35_mtp(transformers.Qwen3_5ForCausalLM(model.config.text_config), randomize)


VISION_MTP = dict(extra_tensors=qwen35_vision_mtp, saved_config={"text_config": {"mtp_num_hidden_layers": 1}})
# Qwen3.5's vision markers (specials 3..6 of the BPE: mtmd wraps an image in <|vision_start|> ... <|vision_end|>)
QWEN_VISION_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                        "<|image_pad|>", "<|video_pad|>"]
# Qwen3.5's ViT, tiny: width 32, 2 layers of 2 heads of 16 (2D RoPE over 4 + 4 pairs), patch 4 with the 2-frame
# temporal kernel, 8x8 learned positions (resized to each image's grid), 2x2 merged into the text width
QWEN35_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                     temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64)


def _qwen_processor(patch: int, merge: int) -> dict[str, str]:
    """Qwen2-VL's image processor file (the converter reads image_mean/std; mtmd's dynamic sizes are its own)."""
    pre = {"image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
           "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "patch_size": patch, "merge_size": merge,
           "temporal_patch_size": 2, "size": {"shortest_edge": 8 * (patch * merge) ** 2,
                                              "longest_edge": 4096 * (patch * merge) ** 2}}
    return {"preprocessor_config.json": json.dumps(pre, indent=1)}


QWEN3VL_TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_interleaved": True,
                                     "mrope_section": [3, 3, 2]})


def _qwen3vl(config_class: str, model_class: str, text: dict, **extra) -> dict:
    """A Qwen3-VL spec: the text config under the 3-layer ViT whose first two layers feed deepstack features."""
    return dict(config_class=config_class, model_class=model_class, tokenizer="bpe", pre="qwen2",
                config=dict(text_config=text, vision_config=dict(QWEN35_VISION, depth=3, deepstack_visual_indexes=[0, 1]),
                            vision_start_token_id=3, vision_end_token_id=4, image_token_id=5, video_token_id=6,
                            tie_word_embeddings=False),
                specials=QWEN_VISION_SPECIALS, tokens=CHATML_TOKENS, chat_template=CHATML,
                extra_files=_qwen_processor(4, 2), convert_args_mmproj=["--mmproj"], **extra)


# Granite 4.0-H: Mamba-2 layers with a few attention layers (NoPE), Granite's multipliers
GRANITE_TOKENS = dict(specials=["<|end_of_text|>", "<|pad|>", "<|start_of_role|>", "<|end_of_role|>"],
                      tokens={"bos_token": "<|end_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<|pad|>"})
GRANITE = dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=512, rms_norm_eps=1e-5, position_embedding_type="nope",
               embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=8.0,
               tie_word_embeddings=False,  # tied, random E . E_tok makes every step repeat the last token
               mamba_n_heads=4, mamba_n_groups=1, mamba_d_state=16, mamba_d_head=32, mamba_d_conv=4,
               mamba_expand=2, mamba_conv_bias=True, mamba_proj_bias=False)
QK_SCALE = 6.0  # Q and K scaled up: Granite's attention multiplier (1/128) leaves random Q.K uniform otherwise


def granite_adjust(model) -> None:
    """Granite's muP embeddings are small (std 0.1: the multiplier of 12 brings them to the residual's
    scale), so the layers, not the token's own embedding, decide the next token; sharper attention."""
    import torch
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(0.1)
        for layer in model.model.layers:
            if getattr(layer, "self_attn", None) is not None:
                layer.self_attn.q_proj.weight.mul_(QK_SCALE)
                layer.self_attn.k_proj.weight.mul_(QK_SCALE)


GRANITE_LAYERS = ["mamba", "mamba", "attention", "mamba", "mamba", "attention"]  # as the released config.json
# transformers 5 spells them linear_attention / full_attention (and saves that); the converter reads the released names
GRANITE_V5 = dict(GRANITE, layer_types=[{"mamba": "linear_attention"}.get(t, "full_attention") for t in GRANITE_LAYERS])

SPECS = {
    # LFM2-350M / 1.2B's layout: short-conv layers, attention at a few indices; LFM2's FFN width
    # rule (2/3 of block_ff_dim, to a multiple of block_multiple_of)
    "lfm2": dict(config_class="Lfm2Config", model_class="Lfm2ForCausalLM", tokenizer="bpe", pre="lfm2",
                 config=dict(LFM2, num_hidden_layers=6, intermediate_size=96, block_multiple_of=32,
                             block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0,
                             layer_types=["conv", "conv", "full_attention", "conv", "full_attention", "conv"]),
                 **LFM2_TOKENS),
    # LFM2-8B-A1B: dense leading layers, then sigmoid-routed experts with a selection bias
    "lfm2moe": dict(config_class="Lfm2MoeConfig", model_class="Lfm2MoeForCausalLM", tokenizer="bpe", pre="lfm2",
                    config=dict(LFM2, num_hidden_layers=6, intermediate_size=64, moe_intermediate_size=16,
                                num_dense_layers=2, num_experts=4, num_experts_per_tok=2, use_expert_bias=True,
                                norm_topk_prob=True, routed_scaling_factor=1.0,
                                layer_types=["conv", "full_attention", "conv", "conv", "full_attention", "conv"]),
                    **LFM2_TOKENS),
    "qwen35": dict(config_class="Qwen3_5TextConfig", model_class="Qwen3_5ForCausalLM", tokenizer="bpe", pre="qwen35",
                   config=dict(QWEN35, intermediate_size=32), tokens=CHATML_TOKENS, chat_template=CHATML, **MTP),
    # Qwen3.5's vision-language shape (#39): the tiny qwen35 text model under Qwen3_5ForConditionalGeneration
    # with its ViT (QWEN35_VISION; no deepstack in Qwen3.5); convert_args_mmproj: the mmproj pass
    "qwen35-vision": dict(config_class="Qwen3_5Config", model_class="Qwen3_5ForConditionalGeneration",
                          tokenizer="bpe", pre="qwen35",
                          config=dict(text_config=dict(QWEN35, intermediate_size=32), vision_config=QWEN35_VISION,
                                      vision_start_token_id=3, vision_end_token_id=4, image_token_id=5,
                                      video_token_id=6, tie_word_embeddings=False),
                          specials=QWEN_VISION_SPECIALS, tokens=CHATML_TOKENS, chat_template=CHATML,
                          extra_files=_qwen_processor(4, 2), convert_args_mmproj=["--mmproj"], **VISION_MTP),
    # Qwen3-VL-4B's shape (#39): a qwen3 text model (head 16, interleaved M-RoPE sections 3, 3, 2; an untied head: peaked)
    # under Qwen3VLForConditionalGeneration, a ViT like Qwen3.5's but 3 layers whose first two feed deepstack
    # features into the text model's first two layers (the rows 3 x 64 wide)
    "qwen3vl-vision": _qwen3vl("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", QWEN3VL_TEXT),
    # Qwen3-VL-30B-A3B's shape (#39): qwen3vl-vision's text model with softmax top-2 of 4 experts (width 16) in every
    # layer (decoder_sparse_step 1, as released), under Qwen3VLMoeForConditionalGeneration with the same ViT; the
    # experts saved as Qwen/Qwen3-VL-30B-A3B-Instruct has them (transformers 5 writes them transposed)
    "qwen3vlmoe-vision": _qwen3vl("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration",
                                  dict(QWEN3VL_TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                       decoder_sparse_step=1),
                                  saved_layout=lambda k, v: v.transpose(1, 2) if k.endswith(("mlp.experts.gate_up_proj",
                                                                                             "mlp.experts.down_proj")) else v),
    # Qwen2.5-VL's shape (#39): a qwen2 text model (biases on Q, K, V; M-RoPE sections 2, 3, 3 in runs) under
    # Qwen2_5_VLForConditionalGeneration, a ViT of RMS norms and gated SiLU FFNs, patch 14 as released, so that
    # llama.cpp's fixed 112-pixel windows (4x4 merged rows) are smaller than the images' grids; full attention
    # in layers 1 and 3 (n_wa_pattern 2), windows in 0 and 2
    "qwen25vl-vision": dict(config_class="Qwen2_5_VLConfig", model_class="Qwen2_5_VLForConditionalGeneration",
                            tokenizer="bpe", pre="qwen2",
                            config=dict(text_config=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                                         num_attention_heads=4, num_key_value_heads=2,
                                                         max_position_embeddings=512, rms_norm_eps=1e-6,
                                                         bos_token_id=None, eos_token_id=None,  # not 151643/5
                                                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                                          "mrope_section": [2, 3, 3]}),
                                        vision_config=dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2,
                                                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                                                           out_hidden_size=64, window_size=112,
                                                           fullatt_block_indexes=[1, 3]),
                                        vision_start_token_id=3, vision_end_token_id=4, image_token_id=5,
                                        video_token_id=6, tie_word_embeddings=False),
                            specials=QWEN_VISION_SPECIALS, tokens=CHATML_TOKENS, chat_template=CHATML,
                            extra_files=_qwen_processor(14, 2), convert_args_mmproj=["--mmproj"]),
    # Qwen3.5-35B-A3B's FFN: softmax top-k experts plus a sigmoid-gated shared expert
    "qwen35moe": dict(config_class="Qwen3_5MoeTextConfig", model_class="Qwen3_5MoeForCausalLM", tokenizer="bpe",
                      pre="qwen35", config=dict(QWEN35, moe_intermediate_size=8, shared_expert_intermediate_size=16,
                                                num_experts=4, num_experts_per_tok=2),
                      tokens=CHATML_TOKENS, chat_template=CHATML, **MTP),
    # Granite 4.0-H-Micro: dense (no experts; the shared MLP is the FFN)
    "granitehybrid": dict(config_class="GraniteMoeHybridConfig", model_class="GraniteMoeHybridForCausalLM",
                          tokenizer="bpe", pre="dbrx",
                          config=dict(GRANITE_V5, intermediate_size=32, shared_intermediate_size=32,
                                      num_local_experts=0, num_experts_per_tok=0),
                          saved_config={"layer_types": GRANITE_LAYERS}, adjust=granite_adjust, **GRANITE_TOKENS),
    # Granite 4.0-H-Tiny: experts plus a shared expert
    "granitehybrid-moe": dict(config_class="GraniteMoeHybridConfig", model_class="GraniteMoeHybridForCausalLM",
                              tokenizer="bpe", pre="dbrx",
                              config=dict(GRANITE_V5, intermediate_size=8, shared_intermediate_size=16,
                                          num_local_experts=4, num_experts_per_tok=2),
                              saved_config={"layer_types": GRANITE_LAYERS}, adjust=granite_adjust, **GRANITE_TOKENS),
}
