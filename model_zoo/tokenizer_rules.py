"""llama.cpp's vocabulary tables and text rules (src/llama-vocab.cpp), kept apart from the
Tokenizer that applies them: token attributes, the token texts it recognizes as
end-of-generation and FIM markers, and its detokenizer's space clean-up."""

from __future__ import annotations

# llama_token_attr bits, from GGUF tokenizer.ggml.token_type (llama_token_type).
UNDEFINED, UNKNOWN, UNUSED, NORMAL, CONTROL, USER_DEFINED, BYTE = 0, 1, 2, 4, 8, 16, 32
TYPE_TO_ATTR = {1: NORMAL, 2: UNKNOWN, 3: CONTROL, 4: USER_DEFINED, 5: UNUSED, 6: BYTE}
SPECIAL = CONTROL | USER_DEFINED | UNKNOWN   # split out of the text before tokenizing
LSTRIP, RSTRIP = 128, 256  # the whitespace before / after the token goes with it (set by model name)

# Texts llama.cpp treats as end-of-generation (load(): "maintain a list of tokens ...").
EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~["))
# Texts that name a token when its id key is absent (llama.cpp's auto-detection).
AUTO_DETECT = {
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
            "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
            "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}


def clean_spaces(text: str) -> str:
    """llama.cpp's clean_up_tokenization_spaces (detokenize), pass for pass and in place
    as there, so that its quirks match; it only touches ASCII, so code points do."""
    t = list(text)
    n, total = len(t), min(len(t), 1)
    for i in range(1, n):  # " ?", " !", " .", " ," lose the space
        x = t[i]
        if t[i - 1] == " " and x in "?!.,":
            total -= 1
        t[total] = x
        total += 1
    n, total, i = total, min(total, 1), 1
    while i < n:  # " ' " loses both spaces
        x = t[i]
        if x == "'" and i + 1 < n and t[i - 1] == " " and t[i + 1] == " ":
            total -= 1
            i += 1
            t[i] = "\0"
        t[total] = x
        total += 1
        i += 1
    n, total = total, min(total, 1)
    for i in range(1, n):  # " 's", " 'm", " 're", " 've" lose the space
        x = t[i]
        if t[i - 1] == " " and x == "'" and i + 1 < n:
            x1 = t[i + 1]
            if x1 in ("s", "m") or (x1 not in ("t", "d") and i + 2 < n
                                    and x1 + t[i + 2] in ("re", "ve")):
                total -= 1
        t[total] = x
        total += 1
    return "".join(t[:total])
