"""A character-level tokenizer for the task, saved as an ordinary Hugging Face tokenizer.

One token per character, so token ids and text map one-to-one. It is a `tokenizers`
WordLevel model wrapped in `PreTrainedTokenizerFast`, which both Transformers and vLLM load
offline from the model directory (`tokenizer.json` + `tokenizer_config.json`).
"""

from __future__ import annotations

EOS = "<|endoftext|>"
CHARS = list("0123456789") + ["+", "-", "*", "=", " "]
VOCAB = [EOS] + CHARS  # 16 tokens: id 0 is end-of-text (also used as padding)


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(VOCAB)}, unk_token=EOS))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS, pad_token=EOS)
    tok.add_special_tokens({"eos_token": EOS, "pad_token": EOS})
    return tok


def check_text(text: str) -> str:
    """The tokenizer maps unknown characters to EOS; refuse them instead of corrupting a prompt."""
    bad = sorted(set(text) - set(CHARS))
    if bad:
        raise ValueError(f"characters {bad!r} are not in the task vocabulary {''.join(CHARS)!r}")
    return text
