"""Mistral 3's vision-language shape (#39, projector pixtral): Mistral3ForConditionalGeneration over a tiny Ministral 3
text model (the converter's "mistral3", as specs_decoders' "mistral3") and a Pixtral tower: 3 RMS-norm layers of
width 32 (2 heads of 16; 3: the converter maps mm.{1,2} only below the layer count), patch 4, a 2D RoPE (theta
10000), a gated SiLU FFN; then Mistral Small 3.1's patch merger (spatial_merge_size 2: RMS norm, 2x2 unfold, a
linear) and the GELU MLP. The converter copies [IMG_BREAK]'s embedding row into the mmproj (v.token_embd.img_break),
which clip.cpp appends after each row of image rows but the last; mtmd ends an image with [IMG_END]. Images keep
their aspect (dyn_size: sides multiples of 8, 8 to 1024 rows)."""
import json

from specs_decoders import MINISTRAL3_ROPE, SMALL, TEKKEN_TOKENS

# Mistral's image tokens as its tekken vocabulary has them (special, single ids)
PIXTRAL_SPECIALS = TEKKEN_TOKENS["specials"] + ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
PIXTRAL_PROCESSOR = {"image_processor_type": "PixtralImageProcessor", "processor_class": "PixtralProcessor",
                     "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
                     "patch_size": 4, "size": {"longest_edge": 256}, "do_normalize": True, "do_rescale": True,
                     "resample": 3, "rescale_factor": 1 / 255}
# 512 positions (YaRN 32x from 16): the long prompt is 360 tokens, and the context is capped at the trained one
ROPE = dict(MINISTRAL3_ROPE, factor=32.0, max_position_embeddings=512)
PIXTRAL_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, head_dim=16,
                      image_size=64, patch_size=4, hidden_act="silu",
                      rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})

SPECS = {
    "mistral3-vision": dict(config_class="Mistral3Config", model_class="Mistral3ForConditionalGeneration",
                            tokenizer="bpe", pre="tekken", specials=PIXTRAL_SPECIALS, tokens=TEKKEN_TOKENS["tokens"],
                            tokenizer_config=TEKKEN_TOKENS["tokenizer_config"],
                            config=dict(text_config=dict(SMALL, model_type="ministral3", max_position_embeddings=512,
                                                         rope_parameters=ROPE, tie_word_embeddings=True,
                                                         bos_token_id=1, eos_token_id=2, pad_token_id=None),
                                        vision_config=PIXTRAL_VISION, spatial_merge_size=2,
                                        image_token_index=PIXTRAL_SPECIALS.index("[IMG]"),
                                        projector_hidden_act="gelu", multimodal_projector_bias=False,
                                        tie_word_embeddings=True),
                            # this converter's mmproj pass drops every "language_model." tensor before it copies
                            # [IMG_BREAK]'s row: the embedding saved under the name the pass reads (clip.cpp needs it)
                            saved_names=[("language_model.model.embed_tokens.", "model.embed_tokens.")],
                            extra_files={"preprocessor_config.json": json.dumps(PIXTRAL_PROCESSOR, indent=1)},
                            convert_args_mmproj=["--mmproj"]),
}
