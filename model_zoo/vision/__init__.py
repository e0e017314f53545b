"""Vision: mmproj files (general.architecture "clip": a vision tower and its projector, read as
llama.cpp's libmtmd reads them, tools/mtmd), the towers as graphs over shared ViT blocks
(`vit`), one file per projector type, and image decoding and preprocessing beside them."""
