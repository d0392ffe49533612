"""A conversation's token ids, grown turn by turn without re-tokenising what was sampled.

Rendering the whole chat again after every turn and tokenising it drifts from what the model
sampled (the same text can tokenise another way; templates rewrite past turns, e.g. drop
reasoning), and training on those ids trains on tokens the policy never produced. So only
new messages are rendered: the first prompt whole, then each observation as the text the
chat template adds after an assistant turn (rendered after a stand-in conversation and cut
after the stand-in's reply and its end of turn), tokenised on its own and appended to the
sampled ids.

What the template writes after an assistant turn's end-of-turn token (Qwen: a newline after
``<|im_end|>``) is prepended to the observation, so the conversation reads as the template
would have rendered it; a turn cut at its token budget gets the whole end of turn.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from drivetrain.api.environment import Message
from drivetrain.trainer.errors import DataError

#: the stand-in conversation observations are rendered after; the assistant text is one no
#: template rewrites and no tokenizer merges with what follows
_REPLY = "Hello."
_BASE = ({"role": "user", "content": "Hi."}, {"role": "assistant", "content": _REPLY})


class ChatTokens:
    """Token ids of chat messages under ``tokenizer``'s chat template with ``tools``."""

    def __init__(self, tokenizer: Any, tools: Sequence[Mapping[str, Any]] = ()) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError("multi-turn episodes need a tokenizer with a chat template")
        self.tokenizer = tokenizer
        self.tools = [dict(t) for t in tools] or None
        #: what the template writes after an assistant turn's content (its end of turn)
        self._turn_end_text = self._after_reply(self.render(_BASE, generation=False))
        self.turn_end = self.encode(self._turn_end_text)
        # a template this cannot follow fails here, before any episode runs
        self.observation_text([{"role": "user", "content": "Go on."}])

    @functools.cached_property
    def longest_token(self) -> int:
        """The most characters one token stands for: its vocabulary string, which decodes to
        no more characters (byte-level BPE writes one character per byte, SentencePiece one
        per character, byte fallback six per byte). A text of ``n`` characters is at least
        ``n / longest_token`` tokens, known without tokenising it."""
        return max((len(token) for token in self.tokenizer.get_vocab()), default=1)

    def render(self, messages: Sequence[Message], *, generation: bool) -> str:
        return self.tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=self.tools,
            tokenize=False,
            add_generation_prompt=generation,
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(self, messages: Sequence[Message]) -> list[int]:
        """The first prompt: the messages rendered with the generation prompt."""
        return self.encode(self.render(messages, generation=True))

    def observation(self, messages: Sequence[Message], sampled: Sequence[int]) -> list[int]:
        """The ids to append after the sampled assistant turn ``sampled``: the rest of its end
        of turn, ``messages`` (tool results, a user turn) and the next generation prompt."""
        return self.end_of_turn(sampled) + self.encode(self.observation_text(messages))

    def observation_text(self, messages: Sequence[Message]) -> str:
        """``messages`` and the next generation prompt as the template writes them after an
        assistant turn's end. Cut after the stand-in reply, not after the stand-in's whole
        rendering: templates render a conversation's last assistant turn differently (Qwen3
        adds an empty think block) and may write the date."""
        text = self._after_reply(self.render([*_BASE, *messages], generation=True))
        if not text.startswith(self._turn_end_text):
            raise DataError(
                "the chat template ends an assistant turn differently once messages follow "
                "it, so observation tokens cannot be appended to sampled ones"
            )
        return text[len(self._turn_end_text) :]

    @staticmethod
    def _after_reply(text: str) -> str:
        at = text.find(_REPLY)
        if at < 0:
            raise DataError("the chat template does not render an assistant turn's content")
        return text[at + len(_REPLY) :]

    def end_of_turn(self, sampled: Sequence[int]) -> list[int]:
        """What closes the sampled turn the way the template closes one: after its own
        end-of-turn token (or EOS), what the template writes next; after a turn cut short,
        all of it."""
        end = self.turn_end
        if end and sampled and sampled[-1] in (end[0], self.tokenizer.eos_token_id):
            return end[1:]
        return list(end)

    def decode(self, ids: Sequence[int]) -> str:
        """A sampled turn's text as a tool parser reads it (special tokens such as the end of
        turn dropped; tool-call markers are ordinary added tokens and stay)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
