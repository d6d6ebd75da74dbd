"""Text at the API edge: the served tokenizer, its chat template, and streaming detokenization.

The engine works in token ids only; the ingress turns prompts into ids and output ids back
into text. Stop strings are matched here, on text, because a stop string may span tokens
(and a token may end in the middle of one): text is held back while it could still be the
start of a stop string, and a request that hits one is cancelled in the engine. The matching
itself is `target_worker.stop_strings`, the same rule the engine applies in-process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from outrider.target_worker.stop_strings import find_stop, held_back

# The demo tokenizer is trained on Python source and ships no chat template; this one lays a
# conversation out as comments, which the demo target continues as naturally as anything.
DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "# {{ message['role'] }}: {{ message['content'] }}\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}# assistant:{%- endif -%}"
)


def load_tokenizer(path: str | Path, chat_template: str | None = None):
    """AutoTokenizer for `path`; the chat template is the override, the tokenizer's own, or the default."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    elif not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    return tokenizer


def apply_chat_template(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


@dataclass
class Detokenizer:
    """Output ids -> text deltas, holding back what might be an incomplete character or a stop string."""

    tokenizer: object
    stops: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    sent: int = 0  # characters of the decoded text already returned
    stopped: bool = False

    def add(self, token_ids: Sequence[int]) -> str:
        """The new text that is safe to send; sets `stopped` when a stop string appeared."""
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        # Decoding the whole output each time is quadratic, but outputs here are short and the
        # BPE merge across the token boundary makes per-token decoding wrong.
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        hit = find_stop(text, self.stops, self.sent)
        if hit is not None:
            self.stopped = True
            return self._emit(text, hit[0])
        safe = len(text)
        if text.endswith("\ufffd"):  # a multi-byte character still incomplete
            safe = len(text.rstrip("\ufffd"))
        # A suffix that is a prefix of a stop string may still become one.
        return self._emit(text, min(safe, len(text) - held_back(text, self.stops)))

    def flush(self) -> str:
        """At the end of the output: whatever was held back (never past a stop)."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        return self._emit(text, len(text))

    def _emit(self, text: str, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta, self.sent = text[self.sent : upto], upto
        return delta


def longest_token_chars(tokenizer) -> int:
    """An upper bound on the characters of text one token can stand for.

    The longest entry of the vocabulary as written (added and special tokens included): a
    byte-level BPE token of n bytes is written as n characters and decodes to at most n, a
    SentencePiece piece is written as its text. So a prompt of more than context x this many
    characters cannot fit the context. A tokenizer whose normalizer deletes characters breaks
    the bound: set `request_limits.max_prompt_chars` for it.
    """
    return max((len(token) for token in tokenizer.get_vocab()), default=1)
