"""The target's path-dependent processors on a drafter's q: penalties, logit_bias, min_tokens.

The target processes each tree node's p with the tokens on that node's path
(`outrider/target_worker/logits_processors.py`, docs/algorithms.md section 2d). A model drafter that
processes its own logits the same way, each row with *its* path, draws from a q closer to p,
so more of its drafts are accepted; verification is lossless either way (it tests against the
target's processed p, and a sampled child is drawn from the q row that is sent).

    row of the frontier at depth d:  context = committed tokens (sent by the target) + d drafts
    counts  = the sequence's committed output counts + the d draft tokens on the row's path
    short   = len(output) + d < min_tokens  ->  the stop ids masked

The same functions as the target's do the work (`penalize_paths`, `mask_stops`,
`add_logit_bias`). The grammar mask is not applied here: a drafter holds no grammar matcher.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from outrider.proto import SamplingParams, SequenceUpdate
from outrider.target_worker.logits_processors import (
    Penalties,
    add_logit_bias,
    committed_counts,
    mask_stops,
    penalize_paths,
)


class DraftProcessors:
    """Per round: processes draft logits rows of a batch, each with its sequence's committed
    tokens and its own path (`__call__`). Sequences without a processor cost nothing."""

    def __init__(
        self,
        samplings: Sequence[SamplingParams],  # [batch] what the target sent with each update
        contexts: Sequence[Sequence[int]],  # [batch] committed tokens (prompt + output, root last)
    ) -> None:
        self.samplings = samplings
        self.todo = [b for b, s in enumerate(samplings) if s.processes_logits]
        self.output_len = {b: max(0, len(contexts[b]) - samplings[b].num_prompt) for b in self.todo}
        self.penalized = [b for b in self.todo if samplings[b].penalized]
        self.penalties = [
            Penalties(
                s.repetition_penalty,
                s.frequency_penalty,
                s.presence_penalty,
                list(contexts[b][s.num_prompt :]),
                list(contexts[b][: s.num_prompt]) if s.repetition_penalty != 1.0 else [],
            )
            for b, s in ((b, samplings[b]) for b in self.penalized)
        ]
        self.committed: tuple[torch.Tensor, torch.Tensor | None] | None = None  # `committed_counts`

    @classmethod
    def of(cls, updates: Sequence[SequenceUpdate], states: Sequence) -> DraftProcessors | None:
        """From a round's updates and the proposer states holding each sequence's committed
        `tokens`; None when no sequence has a processor (the drafter's plain path)."""
        if not any(u.sampling.processes_logits for u in updates):
            return None
        return cls([u.sampling for u in updates], [s.tokens for s in states])

    def __call__(
        self,
        logits: torch.Tensor,  # [R, vocab] draft logits, one row per frontier node
        seq_index: torch.Tensor,  # [R] int64; each row's sequence (position in the batch)
        drafts: torch.Tensor,  # [R, d] int64; the draft tokens on each row's path (d may be 0)
    ) -> torch.Tensor:  # [R, vocab]; float32 where any row was processed, else `logits` itself
        if not self.todo:
            return logits
        seq = seq_index.tolist()
        rows_of = {b: [] for b in self.todo}
        for r, b in enumerate(seq):
            if b in rows_of:
                rows_of[b].append(r)
        if not any(rows_of.values()):
            return logits
        out, depth, device = logits.float().clone(), drafts.shape[1], logits.device
        for b, rows in rows_of.items():
            s = self.samplings[b]
            if rows and (s.logit_bias or (s.min_tokens and s.stop_ids)):
                index = torch.tensor(rows, device=device)
                block = out[index]
                if s.min_tokens and s.stop_ids and self.output_len[b] + depth < s.min_tokens:
                    block = mask_stops(
                        block, torch.ones(len(rows), dtype=torch.bool, device=device), s.stop_ids
                    )
                out[index] = add_logit_bias(block, s.logit_bias)
        rows = [r for b in self.penalized for r in rows_of[b]]
        if rows:
            slot = [i for i, b in enumerate(self.penalized) for _ in rows_of[b]]
            index = torch.tensor(rows, device=device)
            path_row = torch.arange(len(rows), device=device).repeat_interleave(depth)
            path_token = drafts.to(device)[index].flatten()
            if self.committed is None:  # the same for every depth of the round
                self.committed = committed_counts(self.penalties, out.shape[-1], device)
            out[index] = penalize_paths(
                out[index], self.penalties, slot, path_row, path_token, self.committed
            )
        return out
