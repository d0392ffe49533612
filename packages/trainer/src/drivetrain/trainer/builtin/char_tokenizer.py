"""A character-level tokenizer with a chat template, built locally (no hub access).

Every printable ASCII character is one token; role markers and the end-of-turn marker are
special tokens, so prompts, answers and the template tokenize the same way everywhere.
"""

from __future__ import annotations

import string
from pathlib import Path

PAD, END, UNK = "<|pad|>", "<|end|>", "<|unk|>"
ROLES = ("<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_char_tokenizer(
    path: str | Path,
    *,
    roles: tuple[str, ...] = ROLES,
    words: tuple[str, ...] = (),
    chat_template: str = CHAT_TEMPLATE,
) -> Path:
    """Save a ``PreTrainedTokenizerFast`` to ``path`` (EOS = end of turn, PAD separate).
    ``words`` become single ordinary tokens (tool-call markers: decoding keeps them, as it
    keeps Qwen's ``<tool_call>``)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, END, UNK, *roles]
    chars = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]
    vocab = {token: i for i, token in enumerate([*specials, *chars])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=END,
        unk_token=UNK,
        additional_special_tokens=list(roles),
    )
    if words:
        tokenizer.add_tokens(list(words))
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(path))
    return Path(path)
