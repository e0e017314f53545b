"""Gemma 4's vision-language shape (#39, projector gemma4v): a tiny E2B-like gemma4 text model (per-layer inputs;
7 layers, full ones at 1, 4, 6, the last two sharing K/V, so that full layer 1's output for the image rows reaches
later layers' K/V and its causal mask shows in the logits) under Gemma4ForConditionalGeneration with a Gemma 4 vision
tower: 2 RMS-norm layers of width 32 (2 heads of 16), patch 4, a 64-entry x/y position table, clipped linears
(Gemma4ClippableLinear: each linear's input and output clamped to scalars the file carries) and standardized soft
tokens (std_bias, std_scale). The text model is 32 wide, not E2B's 1536 nor E4B's 2560, so that libmtmd decodes its
image rows non-causally (mtmd_decode_use_non_causal), which Gemma 4 applies to its sliding layers only; the record
adds the causal decoding E2B/E4B get (record_vision.py's "gemma4" family)."""
import json

from specs_gemma import GEMMA4, GEMMA4_TOKENS, _gemma_tokens

# Gemma 4's image markers as the released tokenizer has them (special tokens, single ids): mtmd wraps an image in
# <|image> ... <image|>; <|image|> is the processor's soft token
GEMMA4_VISION_TOKENS = dict(GEMMA4_TOKENS, **_gemma_tokens(("<|turn>", "<turn|>", "<|image>", "<image|>", "<|image|>")))
MARKERS = ["<|turn>", "<turn|>", "<|image>", "<image|>", "<|image|>"]  # special tokens (the converter: CONTROL)
GEMMA4_VISION_TOKENS["tokens"].update(boi_token="<|image>", eoi_token="<image|>", image_token="<|image|>",
                                      additional_special_tokens=MARKERS)

GEMMA4_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=64,
                     pooling_kernel_size=3, rms_norm_eps=1e-6, use_clipped_linears=True, standardize=True,
                     rope_parameters={"rope_type": "axial", "rope_theta": 100.0})


def _processor() -> dict[str, str]:
    """Gemma 4's processor files: no normalization (the tower scales pixels to [-1, 1] itself), mean 0, std 1,
    as google/gemma-4-E2B-it's (the converter reads image_mean and image_std)."""
    ip = {"image_processor_type": "Gemma4ImageProcessor", "do_normalize": False, "do_rescale": True,
          "do_resize": True, "image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0], "resample": 3,
          "rescale_factor": 1 / 255, "patch_size": 4, "pooling_kernel_size": 3, "max_soft_tokens": 280}
    return {"preprocessor_config.json": json.dumps(ip, indent=1),
            "processor_config.json": json.dumps({"processor_class": "Gemma4Processor", "image_processor": ip})}


def gemma4v_adjust(model) -> None:
    """Buffers _randomize leaves as transformers makes them: each clipped linear's bounds (inf there) set to
    ranges that clip a tenth or so of its inputs and outputs, and std_bias/std_scale (uninitialized there)."""
    import torch
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, b in sorted(model.named_buffers()):
            u = torch.rand((), generator=g)
            if name.endswith(("input_min", "output_min")):
                b.fill_(-(1.3 + 0.6 * u))
            elif name.endswith(("input_max", "output_max")):
                b.fill_(1.3 + 0.6 * u)
            elif name.endswith("std_bias"):
                b.copy_(torch.randn(b.shape, generator=g))
            elif name.endswith("std_scale"):
                b.copy_((0.3 * torch.randn(b.shape, generator=g)).exp())


SWA, FULL = "sliding_attention", "full_attention"
SPECS = {
    "gemma4-vision": dict(config_class="Gemma4Config", model_class="Gemma4ForConditionalGeneration",
                          tokenizer="spm_bpe",
                          config=dict(text_config=dict(GEMMA4, num_hidden_layers=7,
                                                       layer_types=[SWA, FULL, SWA, SWA, FULL, SWA, FULL],
                                                       num_kv_shared_layers=2, use_double_wide_mlp=True,
                                                       hidden_size_per_layer_input=8, vocab_size_per_layer_input=384),
                                      vision_config=GEMMA4_VISION, audio_config=None, boi_token_id=7, eoi_token_id=8,
                                      image_token_id=9, video_token_id=9, tie_word_embeddings=True),
                          extra_files=_processor(), convert_args_mmproj=["--mmproj"], adjust=gemma4v_adjust,
                          **GEMMA4_VISION_TOKENS),
}
