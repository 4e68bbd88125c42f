"""Megatron-LM's --tokenizer-type names: those this project builds, and the others Megatron
has (named in the refusal so a Megatron user knows it is not a typo)."""

TOKENIZER_TYPES = ("HuggingFaceTokenizer", "Llama2Tokenizer", "GPTSentencePieceTokenizer",
                   "GPT2BPETokenizer", "NullTokenizer")
UNSUPPORTED_MEGATRON_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase",
                              "SentencePieceTokenizer", "TikTokenizer", "MultimodalTokenizer",
                              "NullMultimodalTokenizer", "SFTTokenizer")


def tokenizer_type_problem(name: str) -> str | None:
    """Why --tokenizer-type NAME cannot be used (None: it can)."""
    if name in TOKENIZER_TYPES:
        return None
    known = f"expected one of {', '.join(TOKENIZER_TYPES)}"
    if name in UNSUPPORTED_MEGATRON_TYPES:
        return f"Megatron's {name} is not supported here ({known})"
    return known
