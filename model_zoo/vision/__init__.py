"""Vision input: images read into pixels, preprocessed for a projector's tower (llama.cpp's libmtmd)."""
