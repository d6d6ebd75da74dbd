"""What `kernels.verify` needs beside the trees, for one round's plan: p, greedy rows, randoms.

p        [total_nodes, vocab]  every tree node under its request's sampling parameters
greedy   [B] bool              rows verified by argmax
randoms  VerifyRandoms | None  per-request generators: a seeded request draws the same
                               numbers in any batch (None when every row is greedy)
"""

from __future__ import annotations

import torch

from outrider.kernels import VerifyRandoms, draw_verify_randoms, process_logits
from outrider.target_worker.round_plan import RoundPlan


def target_probs(plan: RoundPlan, logits: torch.Tensor, device: torch.device) -> torch.Tensor:
    """p for every tree node: [total_nodes, vocab], each node under its request's params."""
    cu = plan.trees.cu_num_draft_tokens
    params = [s.params for s in plan.verified]
    if device.type == "cpu" and all(q.temperature == 0 for q in params):
        # All greedy: verification reads only each node's argmax, which the raw logits
        # already have (the CPU verifier's greedy scan); skip the softmax over the vocabulary.
        return logits[: int(cu[-1])]
    first = params[0]
    if first.temperature > 0 and all(
        (q.temperature, q.top_k, q.top_p, q.min_p) == (first.temperature, 0, 1.0, 0.0) for q in params
    ):  # one temperature, no truncation (the common case): a softmax, nothing per row
        return torch.softmax(logits[: int(cu[-1])].float() / first.temperature, dim=-1)
    # [B, 4]: temperature, top_k, top_p, min_p per sequence, then per node.
    table = torch.tensor([[q.temperature, q.top_k, q.top_p, q.min_p] for q in params], device=cu.device)
    if plan.trees.max_num_nodes > 1:
        table = table.repeat_interleave(cu[1:] - cu[:-1], dim=0)
    temperature, top_k, top_p, min_p = table.unbind(1)
    return process_logits(
        logits[: table.shape[0]],
        temperature,
        top_k.long() if any(q.top_k for q in params) else None,
        top_p if any(q.top_p < 1 for q in params) else None,
        min_p if any(q.min_p for q in params) else None,
    )


def greedy_rows(plan: RoundPlan, device: torch.device) -> torch.Tensor:
    return torch.tensor([s.params.temperature == 0 for s in plan.verified], dtype=torch.bool, device=device)


def verify_randoms(plan: RoundPlan, vocab_size: int, device: torch.device) -> VerifyRandoms | None:
    if all(s.params.temperature == 0 for s in plan.verified):
        return None
    generators = [s.generator for s in plan.verified]
    return draw_verify_randoms(plan.trees.cu_num_draft_tokens, vocab_size, generators, device)
