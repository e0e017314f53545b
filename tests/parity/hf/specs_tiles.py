"""The tiled vision-language families (#39; specs.py's SPECS gathers these): SmolVLM (projector idefics3, a
llama text model) and LFM2-VL (projector lfm2, an lfm2 text model). libmtmd cuts an image into tiles plus an
overview and lays out marker tokens between them, which it finds by their text: the tiny vocabularies hold
them (a missing one is LLAMA_TOKEN_NULL in mtmd's prompt)."""
import json

from specs import SMALL
from specs_hybrids import LFM2, LFM2_TOKENS

# SmolVLM's image tokens (its tokenizer's added specials); rows and columns up to 3 (the tiny grids reach 2)
SMOLVLM_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>",
                    "<global-img>"] + [f"<row_{r}_col_{c}>" for r in (1, 2, 3) for c in (1, 2, 3)]
# mtmd looks up "\n\n" (before the overview) and "\n" (a row's end) as single tokens: a trailing blank line
# (one pre-token at the end of a text) makes the BPE learn "\n\n"
NEWLINES = ["Here ends a part.\n\n", "And another.\n\n"] * 8
SMOLVLM_PROCESSOR = {"image_processor_type": "Idefics3ImageProcessor", "processor_class": "SmolVLMProcessor",
                     "do_image_splitting": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                     "resample": 1, "size": {"longest_edge": 64}, "max_image_size": {"longest_edge": 32}}
# LFM2-VL's image tokens: <|image_start|> ... <|image_end|>, <|img_row_R_col_C|> before each tile (up to 2 here),
# <|img_thumbnail|> before the thumbnail
LFM2_VISION_SPECIALS = LFM2_TOKENS["specials"] + ["<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"] \
    + [f"<|img_row_{r}_col_{c}|>" for r in (1, 2) for c in (1, 2)]
LFM2_PROCESSOR = {"image_processor_type": "Lfm2VlImageProcessorFast", "processor_class": "Lfm2VlProcessor",
                  "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_image_splitting": True,
                  "tile_size": 512, "min_tiles": 2, "max_tiles": 10, "min_image_tokens": 64, "max_image_tokens": 256,
                  "encoder_patch_size": 16, "downsample_factor": 2}

SPECS = {
    # SmolVLM-256M's shape: a SigLIP tower (width 32, 2 layers of 2 heads, patch 4 on 32x32 tiles: 8x8 patches, a
    # learned 64-row table), pixel shuffle by 2 (16 rows of 128 per tile) and mm.model.fc into a llama text model;
    # images to a longest edge of 64 (two tiles), then tiles plus the overview
    "smolvlm-vision": dict(config_class="SmolVLMConfig", model_class="SmolVLMForConditionalGeneration",
                           tokenizer="bpe", pre="smollm", specials=SMOLVLM_SPECIALS, corpus=NEWLINES,
                           tokens={"bos_token": "<|im_start|>", "eos_token": "<end_of_utterance>",
                                   "pad_token": "<|endoftext|>"},
                           config=dict(text_config=dict(SMALL, model_type="llama", rope_theta=1e5,
                                                        tie_word_embeddings=False),
                                       vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                                          num_attention_heads=2, image_size=32, patch_size=4,
                                                          layer_norm_eps=1e-6),
                                       scale_factor=2, image_token_id=SMOLVLM_SPECIALS.index("<image>"),
                                       tie_word_embeddings=False),
                           saved_config={"text_config": {"architectures": ["VLlama3ForCausalLM"]}},
                           extra_files={"preprocessor_config.json": json.dumps(SMOLVLM_PROCESSOR, indent=1)},
                           convert_args_mmproj=["--mmproj"]),
    # LFM2-VL-450M's shape: a SigLIP2 NaFlex tower (width 32, 3 layers of 2 heads: the converter maps mm.{1,2} only
    # below the layer count; patch 16, the converter's; a 16x16 table resized to each image's grid), pixel
    # unshuffle by 2, LayerNorm and a 2-layer MLP into a tiny lfm2
    "lfm2-vision": dict(config_class="Lfm2VlConfig", model_class="Lfm2VlForConditionalGeneration", tokenizer="bpe",
                        pre="lfm2", specials=LFM2_VISION_SPECIALS, tokens=LFM2_TOKENS["tokens"],
                        chat_template=LFM2_TOKENS["chat_template"],
                        config=dict(text_config=dict(LFM2, model_type="lfm2", num_hidden_layers=4, intermediate_size=96,
                                                     max_position_embeddings=2048,  # a tiled image is 750 rows
                                                     block_multiple_of=32, block_auto_adjust_ff_dim=True,
                                                     block_ffn_dim_multiplier=1.0,
                                                     layer_types=["conv", "full_attention", "conv", "full_attention"]),
                                    vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                                       num_attention_heads=2, num_patches=256, patch_size=16,
                                                       vision_use_head=False, layer_norm_eps=1e-6),
                                    downsample_factor=2, projector_hidden_size=64, projector_use_layernorm=True,
                                    image_token_id=LFM2_VISION_SPECIALS.index("<image>")),
                        saved_config={"text_config": {"architectures": ["Lfm2ForCausalLM"]}},
                        saved_names=[("model.vision_tower.", "model.vision_tower.vision_model.")],  # LFM2-VL's
                        extra_files={"preprocessor_config.json": json.dumps(LFM2_PROCESSOR, indent=1)},
                        convert_args_mmproj=["--mmproj"]),
}
