"""A round's verified tokens into each sequence, and what each request gains: token deltas and logprobs.

Output token k of a sequence this round was predicted by one tree node: the root for the
first, then each accepted node for the next (the last is the recovered or bonus token drawn
at the last accepted node). Its logprobs are read from that node's row of the *processed*
logits (after the grammar mask, min_tokens, logit_bias and the penalties, with the node's
own path as context: `logits_processors`), log-softmaxed before temperature and top-k/top-p/
min-p truncation, so greedy requests get meaningful numbers. A node's row is the same whether
the token came from a tree or from plain decoding, so logprobs agree with speculation on and
off (to float rounding).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from outrider.kernels import VerifyOutput
from outrider.target_worker.drafter_features import RoundFeatures, keep_features, verified_rows
from outrider.target_worker.round_plan import RoundPlan
from outrider.target_worker.sequence import RequestOutput, TokenLogprob


def append_outputs(
    plan: RoundPlan,
    res: VerifyOutput,
    logits: torch.Tensor,  # [total_nodes, vocab] processed logits (apply_logits_processors)
    features: RoundFeatures | None,
    detokenize: Callable[[list[int]], str] | None,
) -> list[RequestOutput]:
    """Appends each verified sequence's output tokens (up to its stop) and returns its delta."""
    num_output = res.num_output_tokens.tolist()
    output_ids = res.output_token_ids.tolist()
    accepted = res.accepted_node_ids.tolist()
    cu = plan.forward.cu_seqlens
    tree_cu = plan.trees.cu_num_draft_tokens
    tree_sizes = (tree_cu[1:] - tree_cu[:-1]).tolist()
    tree_starts = tree_cu[:-1].tolist()
    outputs = []
    for b, seq in enumerate(plan.verified):
        if features is not None:  # the rows that predicted each new token
            rows = verified_rows(cu[b], cu[b + 1], tree_sizes[b], accepted[b], num_output[b])
            keep_features(seq, features, rows)
        # The root and the accepted nodes are now cached; the last new token is the next root.
        seq.num_cached = len(seq.tokens) + num_output[b] - 1
        new = seq.append(output_ids[b][: num_output[b]], detokenize)
        logprobs = None
        if seq.params.logprobs is not None:
            nodes = [0] + accepted[b][: len(new) - 1]  # the node that predicted each emitted token
            logprobs = token_logprobs(logits[[tree_starts[b] + n for n in nodes]], new, seq.params.logprobs)
        prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None  # sent once, with the first output
        outputs.append(
            RequestOutput(
                request_id=seq.seq_id,
                new_token_ids=new,
                finished=seq.finished,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                text=seq.text if detokenize else None,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            )
        )
    return outputs


def fill_prompts(plan: RoundPlan, features: RoundFeatures | None) -> None:
    """Prompt chunks that stopped short of the root: their tokens are now cached."""
    cu = plan.forward.cu_seqlens
    for i, seq in enumerate(plan.filled, start=len(plan.verified)):
        if features is not None:
            keep_features(seq, features, slice(cu[i], cu[i + 1]))
        seq.num_cached += cu[i + 1] - cu[i]


def record_prompt_logprobs(plan: RoundPlan, logits: torch.Tensor) -> None:
    """The logprobs of the prompt tokens this forward predicted (raw logits: no processor acts
    on the prompt), kept on each sequence until its first output goes out."""
    row = plan.prompt_logits_start
    for seq, count in plan.prompt_logits:
        first = seq.num_cached + 1  # the prompt token the chunk's first row predicts
        entries = token_logprobs(
            logits[row : row + count], seq.tokens[first : first + count], seq.params.prompt_logprobs
        )
        seq.prompt_logprobs = (seq.prompt_logprobs or []) + entries
        row += count


def token_logprobs(rows: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """rows [len(tokens), vocab] logits -> each token's logprob and the `top` likeliest."""
    if not tokens:
        return []
    logp = torch.log_softmax(rows[: len(tokens)].float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])  # [n, 1]
    ranks = ((logp > chosen).sum(-1) + 1).tolist()
    chosen = chosen.squeeze(1).tolist()
    if top:
        values, ids = logp.topk(top, dim=-1)
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(*entry) for entry in zip(tokens, chosen, tops, ranks, strict=True)]


def stop_ids_for(seq_params, eos_token_ids: frozenset[int]) -> frozenset[int]:
    """The ids that end a sequence: the model's EOS ids (unless ignore_eos), and its stop_token_ids.

    A grammar-constrained sequence always stops on EOS: it is how a complete grammar ends."""
    eos = eos_token_ids if (not seq_params.ignore_eos or seq_params.grammar is not None) else frozenset()
    return eos | frozenset(seq_params.stop_token_ids)
