"""Gemma 4 12B's shape (#39, projector gemma4uv, "unified"): Gemma4UnifiedForConditionalGeneration, a gemma4 text
model without per-layer inputs (5 layers, full ones at 1 and 4 with their own K/V head count and K as V, as 31B's;
none share K/V) under an encoder-free vision embedder: raw 12-pixel patches (patch 4 x pooling kernel 3) LayerNorm'd,
projected to 24 (mm_embed_dim, not the text width, so that the final projection is not square), LayerNorm'd, plus
x/y rows of a 64-entry position table, LayerNorm'd, RMS-normed and projected to the text width. The converter
insists on an audio half (audio_config; written as gemma4ua, which this project refuses)."""
import json

from specs_gemma import GEMMA4
from specs_gemma4v import GEMMA4_VISION_TOKENS, _processor

SWA, FULL = "sliding_attention", "full_attention"
UNIFIED_VISION = dict(patch_size=4, pooling_kernel_size=3, mm_embed_dim=24, mm_posemb_size=64, output_proj_dims=24,
                      rms_norm_eps=1e-6)  # output_proj_dims: the embedder RMS-norms and projects mm_embed_dim wide rows

SPECS = {
    "gemma4uv-vision": dict(config_class="Gemma4UnifiedConfig", model_class="Gemma4UnifiedForConditionalGeneration",
                            tokenizer="spm_bpe",
                            config=dict(text_config=dict(GEMMA4, num_hidden_layers=5, layer_types=[SWA, FULL, SWA, SWA,
                                                                                                   FULL],
                                                         num_key_value_heads=2, num_global_key_value_heads=1,
                                                         attention_k_eq_v=True, num_kv_shared_layers=0),
                                        vision_config=UNIFIED_VISION, audio_config=dict(audio_embed_dim=16),
                                        boi_token_id=7, eoi_token_id=8, image_token_id=9, video_token_id=9,
                                        tie_word_embeddings=True),
                            # the converter reads the experts' width unconditionally (Gemma4Model); transformers 5.25's
                            # unified text config has no such key, so config.json carries it as null (no experts)
                            saved_config={"text_config": {"expert_intermediate_size": None}},
                            extra_files=_processor(), convert_args_mmproj=["--mmproj"], **GEMMA4_VISION_TOKENS),
}
# Gemma 4 12B's text file as its users convert it (no --mmproj): the same checkpoint, and a generation_config.json
# with suppress_tokens, which the converter writes for this class only (tokenizer.ggml.suppress_tokens; llama.cpp's
# samplers ban them): the pad and mask tokens and the image soft token, and an id past the vocabulary (dropped)
SPECS["gemma4-12b"] = dict({k: v for k, v in SPECS["gemma4uv-vision"].items() if k != "convert_args_mmproj"},
                           extra_files={**_processor(), "generation_config.json": json.dumps(
                               {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
                                "suppress_tokens": [0, 4, 9, 100000]})})
