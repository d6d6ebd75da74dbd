"""The two ways a peer's message can be refused.

Both are `ValueError`s: the bytes parsed, but what they say is unacceptable. Callers catch
`InvalidDraftError` per message (a bad tree is dropped and counted, the sequence decodes
without it) and `HandshakeMismatchError` once per connection (the pair is refused).
"""

from __future__ import annotations


class InvalidDraftError(ValueError):
    """A message that arrived over the draft wire breaks the contract.

    The message names the sequence, the field, the index, the value and the limit, e.g.
    `tree seq_id=7 round=3: parents[4] = 6 must be in [0, 4)`.
    """


class HandshakeMismatchError(ValueError):
    """Draft and target cannot work together; `mismatches` lists every reason, not just one."""

    def __init__(self, mismatches: list[str]) -> None:
        self.mismatches = list(mismatches)
        lines = "\n".join(f"  - {m}" for m in self.mismatches)
        super().__init__(f"draft/target handshake refused ({len(self.mismatches)} mismatches):\n{lines}")
