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

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from outrider.target_worker.round_plan import RoundPlan
from outrider.target_worker.sequence import Sequence


def apply_logits_processors(plan: RoundPlan, logits: torch.Tensor) -> torch.Tensor:
    """[total_nodes, vocab] logits of every tree node, each processed with its path's context.

    Returns `logits[:total_nodes]` itself when no verified sequence has a processor. Masks and
    biases go sequence by sequence; the penalties of the whole batch are a handful of tensor ops
    (`penalize`), so their cost does not grow with the batch in Python."""
    if plan.trees is None:
        return logits
    cu = plan.trees.cu_num_draft_tokens.tolist()
    todo = [b for b, seq in enumerate(plan.verified) if seq.params.processes_logits]
    if not todo:
        return logits[: cu[-1]]
    out = logits[: cu[-1]].float().clone()
    tokens, parents = plan.trees.token_ids.tolist(), plan.trees.parents.tolist()
    trees = {b: (tokens[cu[b] : cu[b + 1]], parents[cu[b] : cu[b + 1]]) for b in todo}
    for b in todo:
        if _masks_or_biases(plan.verified[b]):
            out[cu[b] : cu[b + 1]] = mask_and_bias(plan.verified[b], out[cu[b] : cu[b + 1]], *trees[b])
    penalized = [b for b in todo if _penalties(plan.verified[b].params)]
    if penalized:
        rows = torch.cat([torch.arange(cu[b], cu[b + 1]) for b in penalized]).to(out.device)
        out[rows] = penalize([plan.verified[b] for b in penalized], out[rows], [trees[b] for b in penalized])
    return out


def process_tree_rows(
    seq: Sequence,
    rows: torch.Tensor,  # [n, vocab] float32; node i's logits (node 0 = the root)
    tokens: torch.Tensor | list[int],  # [n]; node tokens (the root's is already committed)
    parents: list[int],  # [n]; -1 at the root, parents[i] < i
) -> torch.Tensor:  # [n, vocab]
    """What `apply_logits_processors` does to one sequence's rows."""
    tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
    rows = mask_and_bias(seq, rows, tokens, parents)
    return penalize([seq], rows, [(tokens, parents)]) if _penalties(seq.params) else rows


def _masks_or_biases(seq: Sequence) -> bool:
    return seq.grammar is not None or bool(seq.params.min_tokens) or bool(seq.params.logit_bias)


def _penalties(params) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0)


def mask_and_bias(seq: Sequence, rows: torch.Tensor, tokens: list[int], parents: list[int]) -> torch.Tensor:
    """The grammar mask, min_tokens (stop ids masked while the node's output is short), logit_bias."""
    params, vocab, device = seq.params, rows.shape[-1], rows.device
    if seq.grammar is not None:
        rows = rows.masked_fill(~grammar_allowed(seq.grammar, tokens, parents, vocab).to(device), -torch.inf)
    if params.min_tokens and seq.stop_ids:
        depth = [0] * len(parents)  # draft tokens on each node's path
        for i in range(1, len(parents)):
            depth[i] = depth[parents[i]] + 1
        short = torch.tensor([d + len(seq.output_ids) < params.min_tokens for d in depth], device=device)
        rows = mask_stops(rows, short, seq.stop_ids)
    return add_logit_bias(rows, params.logit_bias)


def mask_stops(
    rows: torch.Tensor,  # [n, vocab] float32
    short: torch.Tensor,  # [n] bool; rows whose output (committed + path) is under min_tokens
    stop_ids: Iterable[int],  # EOS and stop_token_ids
) -> torch.Tensor:
    """min_tokens: the stop ids get -inf in the rows that are still short."""
    vocab, device = rows.shape[-1], rows.device
    stop = torch.tensor(sorted(t for t in stop_ids if t < vocab), dtype=torch.int64, device=device)
    rows[short[:, None] & torch.isin(torch.arange(vocab, device=device), stop)] = -torch.inf
    return rows


def add_logit_bias(rows: torch.Tensor, logit_bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """[n, vocab] float32 rows + each (token id, bias) of logit_bias, in place."""
    if logit_bias:
        ids = torch.tensor([t for t, _ in logit_bias], device=rows.device)
        rows[:, ids] += torch.tensor([b for _, b in logit_bias], device=rows.device)
    return rows


@dataclass(frozen=True)
class Penalties:
    """One sequence's penalties and the committed tokens they count (vLLM's semantics)."""

    repetition: float  # 1 = off; every token of prompt + output
    frequency: float  # 0 = off; per occurrence in the output
    presence: float  # 0 = off; once if in the output
    output_ids: list[int]  # committed output tokens (the root included once decoding)
    prompt_ids: list[int]  # read only when repetition != 1


def penalize(
    seqs: list[Sequence],
    rows: torch.Tensor,  # [N, vocab] float32; the nodes of every tree in `trees`, in order
    trees: list[tuple[list[int], list[int]]],  # per sequence: node tokens, parents
) -> torch.Tensor:  # [N, vocab]
    """Repetition, frequency and presence penalties, each node's counts = the committed output's
    + the draft tokens on its path (and the prompt's tokens, for repetition)."""
    slot, path_row, path_token = [], [], []  # per row: its sequence; per (row, path token): both
    for s, (tokens, parents) in enumerate(trees):
        first = len(slot)
        slot += [s] * len(tokens)
        for i in range(1, len(tokens)):  # node i's draft tokens: itself and its ancestors but the root
            j = i
            while j > 0:
                path_row.append(first + i)
                path_token.append(tokens[j])
                j = parents[j]
    penalties = [
        Penalties(
            seq.params.repetition_penalty,
            seq.params.frequency_penalty,
            seq.params.presence_penalty,
            seq.output_ids,
            seq.tokens[: seq.num_prompt] if seq.params.repetition_penalty != 1.0 else [],
        )
        for seq in seqs
    ]
    return penalize_paths(rows, penalties, slot, path_row, path_token)


def committed_counts(
    penalties: list[Penalties], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([S, vocab] float32 output counts, [S, vocab] bool prompt tokens or None if no sequence
    has a repetition penalty): what every row of a sequence starts from."""

    def index(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    out_slot = [s for s, p in enumerate(penalties) for _ in p.output_ids]
    out_ids = [t for p in penalties for t in p.output_ids]
    counts = torch.zeros(len(penalties), vocab, device=device)
    counts.index_put_(
        (index(out_slot), index(out_ids)), torch.ones(len(out_ids), device=device), accumulate=True
    )
    prompt_slot = [s for s, p in enumerate(penalties) for _ in p.prompt_ids]
    if not prompt_slot:
        return counts, None
    in_prompt = torch.zeros(len(penalties), vocab, dtype=torch.bool, device=device)
    in_prompt[index(prompt_slot), index([t for p in penalties for t in p.prompt_ids])] = True
    return counts, in_prompt


def penalize_paths(
    rows: torch.Tensor,  # [N, vocab] float32
    penalties: list[Penalties],  # [S]
    row_seq: list[int] | torch.Tensor,  # [N]; each row's sequence (index into `penalties`)
    path_row: list[int] | torch.Tensor,  # [P]; one entry per (row, draft token on the row's path)
    path_token: list[int] | torch.Tensor,  # [P]
    committed: tuple[torch.Tensor, torch.Tensor | None] | None = None,  # `committed_counts`, if kept
) -> torch.Tensor:  # [N, vocab]
    """The penalties of rows whose counts are their sequence's committed output + their path's
    tokens: two scatter-adds for the whole batch (the target's tree nodes, a drafter's frontier)."""
    device = rows.device
    counts, in_prompt = committed or committed_counts(penalties, rows.shape[-1], device)
    slot = torch.as_tensor(row_seq, dtype=torch.int64).to(device)
    counts = counts[slot]  # [N, vocab]
    path_row = torch.as_tensor(path_row, dtype=torch.int64).to(device)
    path_token = torch.as_tensor(path_token, dtype=torch.int64).to(device)
    counts.index_put_((path_row, path_token), torch.ones(path_row.shape[0], device=device), accumulate=True)
    in_output = counts > 0
    seen = in_output if in_prompt is None else in_output | in_prompt[slot]
    per_seq = torch.tensor(
        [(p.repetition, p.frequency, p.presence) for p in penalties], dtype=torch.float32, device=device
    )
    r, f, s = per_seq[slot].unbind(1)  # [N] each
    # Any r > 0 is accepted: one under float32's range (3e-187 from a client) is 0 here, and
    # a logit over it inf; the largest finite logit instead keeps every row a distribution.
    big, r = torch.finfo(rows.dtype).max, r.clamp(min=torch.finfo(rows.dtype).tiny)[:, None]
    rows = torch.where(seen, torch.where(rows > 0, (rows / r).clamp(max=big), rows * r), rows)
    return rows - f[:, None] * counts - s[:, None] * in_output.float()


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
