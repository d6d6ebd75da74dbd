"""Speculative decoding counters, shaped like vLLM's `spec_decode_*` metrics.

    num_drafts                    sequences verified with at least one draft token
    num_draft_tokens              draft tokens sent to the verifier: for a tree, every node
                                  except the root (for a chain this is vLLM's count, gamma)
    num_accepted_tokens           draft tokens accepted (excludes recovered/bonus tokens)
    num_accepted_tokens_per_pos   [d] = drafts whose accepted path reached depth d + 1

    mean acceptance length (tau) = 1 + accepted / drafts
    acceptance rate              = accepted / draft tokens

Counting every tree node (not the deepest path) makes the acceptance rate the fraction of
verified tokens kept, i.e. the share of verify compute that paid off; a wide tree lowers it
while raising tau. Root-only trees (no speculation this round) are not counted as drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from outrider.kernels.verification import VerifyOutput


@dataclass
class SpecDecodeCounters:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, cu_num_draft_tokens: torch.Tensor, output: VerifyOutput) -> None:
        """Adds one verify step's counts (cu_num_draft_tokens [batch + 1], as verified)."""
        if output.accepted_node_ids.shape[1] == 0:  # root-only trees everywhere: no drafts
            return
        num_draft = (cu_num_draft_tokens[1:] - cu_num_draft_tokens[:-1] - 1).cpu()
        accepted = output.num_accepted.cpu()[num_draft > 0]
        self.num_drafts += int((num_draft > 0).sum())
        self.num_draft_tokens += int(num_draft.sum())
        self.num_accepted_tokens += int(accepted.sum())
        if accepted.numel() and int(accepted.max()) > 0:
            reached = torch.bincount(accepted, minlength=int(accepted.max()) + 1).flip(0).cumsum(0).flip(0)
            self._add_per_pos(reached[1:].tolist())

    def merge(self, other: SpecDecodeCounters) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self._add_per_pos(other.num_accepted_tokens_per_pos)

    def _add_per_pos(self, counts: list[int]) -> None:
        grow = len(counts) - len(self.num_accepted_tokens_per_pos)
        self.num_accepted_tokens_per_pos.extend([0] * max(grow, 0))
        for pos, count in enumerate(counts):
            self.num_accepted_tokens_per_pos[pos] += count

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else float("nan")

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else float("nan")
