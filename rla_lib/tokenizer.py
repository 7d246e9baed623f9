"""A character-level tokenizer for the task, saved as an ordinary Hugging Face tokenizer.

One token per character, so token ids and text map one-to-one. It is a `tokenizers`
WordLevel model wrapped in `PreTrainedTokenizerFast`, which both Transformers and vLLM load
offline from the model directory (`tokenizer.json` + `tokenizer_config.json`).
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"
CHARS = list("0123456789") + ["+", "-", "*", "=", " "]
VOCAB = [EOS] + CHARS  # 16 tokens: id 0 is end-of-text (also used as padding)


def build_tokenizer(vocab_size: int = len(VOCAB)):
    """The task's tokenizer; with a larger `vocab_size`, unused tokens fill the ids past the task's (real shapes)."""
    vocab = VOCAB + [f"<|unused_{i}|>" for i in range(vocab_size - len(VOCAB))]
    core = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(vocab)}, unk_token=EOS))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS, pad_token=EOS)
    tok.add_special_tokens({"eos_token": EOS, "pad_token": EOS})
    return tok
