"""`peagle`: P-EAGLE parallel drafting: K draft positions in ONE forward pass (docs/algorithms.md section 4).

    {"method": "peagle", "model": "/path/to/head", "num_speculative_tokens": 5}              a chain
    {"method": "peagle", "model": ..., "num_speculative_tokens": 5, "tree_top_k": 3,
     "tree_max_nodes": 16}                                                                    a tree

The head is an EAGLE-3 head (`draft_worker.eagle_head`, same checkpoint layout) plus
`mask_hidden` (a learned stand-in for the raw target feature) and `ptd_token_id`. One round,
for the whole batch, is one forward over each sequence's uncached rows followed by K - 1
placeholder rows:

    rows:      ... t_{n-1}  root t_n  | ptd      ptd      ...  ptd
    hidden:    ... g_{n-2}  g_{n-1}   | fc(m)    fc(m)    ...  fc(m)      m = mask_hidden
    position:      n-1      n         | n+1      n+2      ...  n+K-1
    predicts:                d_1      | d_2      d_3      ...  d_K

Placeholder rows go to the scratch rows after the root and are overwritten by the next
round's prefill, as in `eagle3`. A chain takes the argmax of each position; a tree comes from
the per-position distributions through the EAGLE-2 builder (`build_trees`, whose logits for
a depth-d node are position d's, whatever its path), so the q rows are exactly what was drawn
from. Drafting costs one forward whatever K is: that is the point against `eagle3`'s K.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from outrider.draft_worker.eagle3 import Eagle3Proposer, EagleState
from outrider.draft_worker.model_drafting import draft_chains
from outrider.draft_worker.path_processors import DraftProcessors
from outrider.draft_worker.proposer import register_proposer, root_only_tree
from outrider.draft_worker.tree_builder import Frontier, build_trees
from outrider.proto import CandidateTree, SequenceUpdate
from outrider.target_worker.batch import SequenceChunk, build_forward_batch


@register_proposer("peagle")
class PEagleProposer(Eagle3Proposer):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.head.cfg
        if not cfg.parallel_drafting or not hasattr(self.head, "mask_hidden"):
            raise ValueError(
                f"peagle: {self.config.options.model} is not a P-EAGLE head (no mask_hidden / ptd_token_id)"
            )
        with torch.inference_mode():
            self.mask_g = self.head.project(self.head.mask_hidden[None])  # [1, H]

    def _extra_rows(self) -> int:
        return self.config.budget.max_depth  # the K - 1 placeholder rows (and one spare)

    @torch.inference_mode()
    def draft(self, updates: Sequence[SequenceUpdate], states: Sequence[EagleState]) -> list[CandidateTree]:
        drafting = [b for b, s in enumerate(states) if self._admit(s)]
        if not drafting:
            return [root_only_tree(u) for u in updates]
        budgets = self._budgets(updates, states, drafting)
        depth = max(b.max_depth for b in budgets)
        vocab = self.vocab_size
        logits = torch.full((len(updates), max(depth, 1), vocab), float("-inf"), device=self.device)
        live = [b for b in drafting if budgets[b].max_depth > 0]
        if live:
            logits[live, :depth] = self._parallel_logits([states[b] for b in live], depth)
        if all(b.top_k <= 1 for b in budgets) and all(u.sampling.greedy for u in updates):
            # The argmax of each position, no forward per step (sampled chains: the builder's wide q rows).
            return draft_chains(
                updates,
                budgets,
                lambda active: logits[active, 0],
                lambda chain: logits[chain.rows, chain.depth + 1],
                sampled_mode=self.config.sampled_mode,
                processors=DraftProcessors.of(updates, states),
            )

        def position_logits(frontier: Frontier) -> torch.Tensor:  # [rows, vocab]: position d's
            return logits[frontier.seq_index.to(self.device), frontier.depth]

        return build_trees(
            updates,
            budgets,
            logits[:, 0],
            position_logits,
            sampled_mode=self.config.sampled_mode,
            generators=[s.generator for s in states],
            processors=DraftProcessors.of(updates, states),
        )

    def _parallel_logits(self, states: Sequence[EagleState], depth: int) -> torch.Tensor:
        """[len(states), depth, vocab]: the root's and the depth - 1 placeholders' logits, one forward."""
        ptd = self.head.cfg.ptd_token_id
        chunks, hidden = [], []
        for s in states:
            tokens = torch.tensor([*s.tokens[s.cached :], *[ptd] * (depth - 1)], dtype=torch.int64)
            chunks.append(SequenceChunk(s.start, s.cached, tokens, all_logits=True))
            hidden += [s.g[s.cached :], self.mask_g.expand(depth - 1, -1)]
        batch = build_forward_batch(chunks, device=self.device)
        out = self.head_forward(batch, torch.cat(hidden))  # [T, H]
        rows = []
        for i, s in enumerate(states):
            end = batch.cu_seqlens[i + 1]
            rows.append(out[end - depth : end])
            s.cached = len(s.tokens)  # the placeholders' rows are scratch, overwritten next round
        return self.full_logits(torch.cat(rows)).view(len(states), depth, -1)
