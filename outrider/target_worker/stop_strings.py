"""Stop strings on decoded text: the one implementation, for the engine and the HTTP ingress.

A stop string is matched on text, not tokens: it may span tokens, and a token may end in
the middle of one. Both callers decode the output as it grows and ask two questions:

    text:     d e f _ f ( x ) : \\n # E N
              |------ checked ------|       a prefix already known to hold no stop string
                                  |-- new --|
    find_stop(text, stops, checked)   the first stop string that ends in the new part
    held_back(text, stops)            "EN" may still become "END": characters to hold back

`Sequence.append` (the engine, with a `detokenize` function) needs only the first; the
ingress's streaming `Detokenizer` (`cluster.text`) needs both, because it sends text before
the output ends and must never send the start of what turns out to be a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence


def find_stop(text: str, stops: Sequence[str], checked: int = 0) -> tuple[int, str] | None:
    """(where it starts, which) for the earliest stop string in `text`, or None.

    `text[:checked]` held no stop string when it was last looked at, so a match must end past
    it: the search starts at `checked - longest + 1` rather than at 0 (outputs are re-decoded
    every round, and this keeps each look proportional to the new text).
    """
    if not stops:
        return None
    since = max(0, checked - max(len(s) for s in stops) + 1)
    hits = [(at, stop) for stop in stops if (at := text.find(stop, since)) >= 0]
    return min(hits) if hits else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of `text` might be the start of a stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
