"""Fuzzing harnesses for hearthlm's untrusted inputs: GGUF files (gguf_target), tokenizer
text and ids (tokenizer_target), chat templates and messages (template_target). engine.py
runs one target; run.py runs all of them for a time budget (`make fuzz`)."""
