"""Processors that depend on the tokens generated so far, applied at every tree node.

A tree node at depth d predicts the token after it, in the context

    committed tokens (prompt + output, the root last) + the d draft tokens on root -> node

so each processor is applied to each node's logits row with *that* context: penalties count
the node's path, min_tokens counts its depth, the grammar matcher is advanced along it (and
rolled back after). p at every node is then exactly what plain decoding computes once it has
emitted that path, and verification stays lossless (docs/algorithms.md section 2d). Counting
only the committed tokens (the last accepted token's context for the whole tree) would make
the effective penalty about nominal / acceptance length, as SGLang's does.

Order and semantics follow vLLM V1's sampler: the grammar mask, min_tokens (stop ids masked
until the output is long enough), logit_bias, then the penalties:

    repetition  every token seen in prompt + output:  logit / r if logit > 0 else logit * r
    frequency   logit -= f * (count of the token in the output)
    presence    logit -= s * (1 if the token is in the output)

Sequences without any of them (`RequestParams.processes_logits` false) cost nothing here.
"""

from __future__ import annotations

import torch

from outrider.target_worker.round_plan import RoundPlan
from outrider.target_worker.sequence import Sequence


def apply_logits_processors(plan: RoundPlan, logits: torch.Tensor) -> torch.Tensor:
    """[total_nodes, vocab] logits of every tree node, each processed with its path's context.

    Returns `logits[:total_nodes]` itself when no verified sequence has a processor."""
    if plan.trees is None:
        return logits
    cu = plan.trees.cu_num_draft_tokens.tolist()
    todo = [b for b, seq in enumerate(plan.verified) if seq.params.processes_logits]
    if not todo:
        return logits[: cu[-1]]
    out = logits[: cu[-1]].float().clone()
    tokens, parents = plan.trees.token_ids.cpu(), plan.trees.parents.cpu()
    for b in todo:
        start, end = cu[b], cu[b + 1]
        tree_tokens, tree_parents = tokens[start:end], parents[start:end].tolist()
        out[start:end] = process_tree_rows(plan.verified[b], out[start:end], tree_tokens, tree_parents)
    return out


def process_tree_rows(
    seq: Sequence,
    rows: torch.Tensor,  # [n, vocab] float32; node i's logits (node 0 = the root)
    tokens: torch.Tensor,  # [n] int64; node tokens (the root's is already committed)
    parents: list[int],  # [n]; -1 at the root, parents[i] < i
) -> torch.Tensor:  # [n, vocab]
    params, vocab = seq.params, rows.shape[-1]
    path = path_matrix(parents).to(rows.device)  # [n, n]: node j (j >= 1) is on node i's path
    depth = path.sum(1)  # [n] draft tokens on each node's path
    if seq.grammar is not None:
        rows = rows.masked_fill(
            ~grammar_allowed(seq.grammar, tokens.tolist(), parents, vocab).to(rows.device), -torch.inf
        )
    if params.min_tokens and seq.stop_ids:
        short = depth + len(seq.output_ids) < params.min_tokens  # [n]
        stop = torch.tensor(sorted(seq.stop_ids), device=rows.device)
        stop = stop[stop < vocab]
        rows[short[:, None] & torch.isin(torch.arange(vocab, device=rows.device), stop)] = -torch.inf
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], device=rows.device)
        bias = torch.tensor([b for _, b in params.logit_bias], device=rows.device)
        rows[:, ids] += bias
    if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0:
        output = torch.tensor(seq.output_ids, dtype=torch.int64)
        counts = torch.bincount(output, minlength=vocab)[:vocab].float().to(rows.device)  # [vocab]
        drafted = torch.nn.functional.one_hot(tokens.to(rows.device), vocab).float()  # [n, vocab]
        counts = counts + path.float() @ drafted  # [n, vocab]: output + path counts per node
        prompt_seen = None
        if params.repetition_penalty != 1.0:
            prompt = torch.tensor(seq.tokens[: seq.num_prompt], dtype=torch.int64)
            prompt_seen = (torch.bincount(prompt, minlength=vocab)[:vocab] > 0).to(rows.device)
        rows = apply_penalties(rows, counts, prompt_seen, params)
    return rows


def apply_penalties(
    rows: torch.Tensor,  # [n, vocab] float32
    output_counts: torch.Tensor,  # [n, vocab] float32; each token's count in the row's output
    prompt_seen: torch.Tensor | None,  # [vocab] bool; in the prompt (for repetition), None = unused
    params,  # RequestParams
) -> torch.Tensor:
    if params.repetition_penalty != 1.0:
        seen = output_counts > 0
        if prompt_seen is not None:
            seen = seen | prompt_seen
        r = params.repetition_penalty
        rows = torch.where(seen, torch.where(rows > 0, rows / r, rows * r), rows)
    if params.frequency_penalty:
        rows = rows - params.frequency_penalty * output_counts
    if params.presence_penalty:
        rows = rows - params.presence_penalty * (output_counts > 0).float()
    return rows


def path_matrix(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: entry (i, j) says draft node j (j >= 1) is node i itself or an ancestor."""
    n = len(parents)
    path = torch.zeros(n, n, dtype=torch.bool)
    for i in range(1, n):
        path[i] = path[parents[i]]
        path[i, i] = True
    return path


def grammar_allowed(matcher, tokens: list[int], parents: list[int], vocab: int) -> torch.Tensor:
    """[n, vocab] bool: the tokens the grammar allows after each node, the matcher advanced along
    the node's path and rolled back after (it ends where it started: at the committed tokens).

    A node whose own token the grammar refuses is never reached by verification (its parent's
    row gives its token probability 0); its subtree gets its parent's row, so every row stays a
    distribution. A row after a completed grammar (a stop token on the path) is unconstrained.
    """
    from outrider.target_worker.grammar import allowed_tokens

    n = len(tokens)
    allowed = torch.ones(n, vocab, dtype=torch.bool)
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        children[parents[i]].append(i)
    if matcher.is_terminated():  # complete, and its stop token is not one of the model's
        return allowed
    allowed[0] = allowed_tokens(matcher, vocab)
    stack = [(c, True) for c in reversed(children[0])]
    while stack:
        node, entering = stack.pop()
        if not entering:
            matcher.rollback(1)
            continue
        if not matcher.accept_token(tokens[node]):
            for d in _subtree(node, children):
                allowed[d] = allowed[parents[node]]
            continue
        allowed[node] = allowed_tokens(matcher, vocab) if not matcher.is_terminated() else True
        stack.append((node, False))
        stack.extend((c, True) for c in reversed(children[node]))
    return allowed


def _subtree(node: int, children: list[list[int]]) -> list[int]:
    out, todo = [], [node]
    while todo:
        u = todo.pop()
        out.append(u)
        todo.extend(children[u])
    return out
