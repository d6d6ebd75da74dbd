"""Lossless verification of candidate trees (docs/algorithms.md sections 1-2).

Each tree is walked from its root; at an accepted node its children are tried in local index
order. Greedy sequences accept a child iff its token is the target argmax. Sampled sequences
test child x against the residual r of the current node (r starts as p, sum S) and the
working draft distribution q (sparse, renormalised here over its support):

    DETERMINISTIC        accept if u < r(x)/S            reject: r(x) = 0
    WITH_REPLACEMENT     accept if u * q(x) < r(x)/S     reject: r = relu(r/S - q)
    WITHOUT_REPLACEMENT  as above, and on reject also    q(x) = 0, q renormalised

A child whose token has q(x) = 0 is rejected (an honest drafter never sends one). When no
child is accepted the output ends with a token drawn from r (recovered; from p itself when
the node has no children: bonus). A chain is the tree with one child per node, so chain
verification (min(1, p/q), residual max(0, p - q), bonus from p) is this same walk.

Randomness is an input (`VerifyRandoms`): one uniform per node and one exponential per
(sequence, vocab entry). A token is drawn from r as argmax_v r(v) / E_v (the exponential
race: P(v) = r(v) / S), which needs no cumulative sum, so the torch reference and the Triton
kernel pick the same token from the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from outrider.kernels.backend import Backend, use_triton
from outrider.kernels.packing import PackedTrees
from outrider.kernels.verification_host import HOST_MAX_BATCH, walk_host
from outrider.proto.tree import DraftSampling

_DETERMINISTIC = int(DraftSampling.DETERMINISTIC)
_WITHOUT_REPLACEMENT = int(DraftSampling.WITHOUT_REPLACEMENT)


@dataclass
class VerifyRandoms:
    uniforms: torch.Tensor  # [total_nodes] float32 in [0, 1); node i's acceptance test
    # [batch, vocab] float32 > 0; Exp(1) noise for the final draw. None when every tree is
    # root-only (plain decoding): the final draw is then by inverse CDF with the root's uniform.
    exponentials: torch.Tensor | None


@dataclass
class VerifyOutput:
    accepted_node_ids: torch.Tensor  # [batch, max_num_nodes - 1] int64; local nodes, -1 pad
    output_token_ids: torch.Tensor  # [batch, max_num_nodes] int64; accepted + recovered/bonus, -1 pad
    num_output_tokens: torch.Tensor  # [batch] int64; >= 1

    @property
    def num_accepted(self) -> torch.Tensor:  # [batch] int64
        return self.num_output_tokens - 1


def draw_verify_randoms(
    cu_num_draft_tokens: torch.Tensor,  # [batch + 1] int64
    vocab_size: int,
    generators: Sequence[torch.Generator | None] | torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> VerifyRandoms:
    """Random inputs of `verify`; per-request generators make each request reproducible.

    `generators` is one generator for the whole batch, or one per sequence (None entries use
    torch's default generator): a seeded request gets the same numbers whatever it is batched
    with. Generators must live on `device`. A root-only tree (plain decoding of one token)
    takes one uniform and no exponentials: its token is drawn by inverse CDF (`verify`), so
    plain decoding does not pay a vocabulary's worth of noise per token; `exponentials` is
    None when every tree is root-only.
    """
    device = torch.device(device or cu_num_draft_tokens.device)
    sizes = (cu_num_draft_tokens[1:] - cu_num_draft_tokens[:-1]).tolist()
    drafted = [n > 1 for n in sizes]
    shared = generators is None or isinstance(generators, torch.Generator)
    if shared:
        uniforms = torch.rand(sum(sizes), generator=generators, device=device)
    else:
        per_seq = zip(sizes, generators, strict=True)
        uniforms = torch.cat(
            [torch.rand(n, generator=g, device=device) for n, g in per_seq] or [torch.empty(0, device=device)]
        )
    if not any(drafted):
        return VerifyRandoms(uniforms, None)
    if shared:
        exponentials = torch.empty(len(sizes), vocab_size, device=device).exponential_(generator=generators)
    else:
        ones = torch.ones(vocab_size, device=device)  # root-only rows: never read (inverse CDF)
        exponentials = torch.stack(
            [
                torch.empty(vocab_size, device=device).exponential_(generator=g) if d else ones
                for d, g in zip(drafted, generators, strict=True)
            ]
        )
    # exponential_ may return 0, and r / 0 would make a zero-probability token win the race.
    return VerifyRandoms(uniforms, exponentials.clamp_min_(torch.finfo(torch.float32).tiny))


def verify(
    trees: PackedTrees,
    target_probs: torch.Tensor,  # [total_nodes, vocab] float32; p after node i (process_logits)
    is_greedy: torch.Tensor,  # [batch] bool
    randoms: VerifyRandoms | None = None,  # may be None only when every sequence is greedy
    backend: Backend | None = None,
) -> VerifyOutput:
    all_greedy = bool(is_greedy.all())
    if randoms is None:
        if not all_greedy:
            raise ValueError("sampled sequences need VerifyRandoms (see draw_verify_randoms)")
        randoms = VerifyRandoms(
            torch.zeros(trees.token_ids.numel(), device=target_probs.device),
            torch.ones(trees.batch_size, 1, device=target_probs.device),
        )
    if trees.max_num_nodes == 1:  # no draft anywhere (plain decoding): nothing to walk
        return verify_roots(target_probs, is_greedy, randoms)
    if use_triton(backend, target_probs.device):
        from outrider.kernels.verification_triton import verify_triton

        out = verify_triton(trees, target_probs, is_greedy, randoms)
    elif target_probs.device.type == "cpu" and (all_greedy or trees.batch_size <= HOST_MAX_BATCH):
        out = verify_host(trees, target_probs, is_greedy, randoms)
    else:
        out = verify_reference(trees, target_probs, is_greedy, randoms)
    if all_greedy:  # (no sampled root-only tree to draw for)
        return out
    # Root-only trees of sampled sequences beside drafted ones: their token by inverse CDF with
    # their one uniform, as when the whole batch is root-only (`draw_verify_randoms`).
    starts = trees.cu_num_draft_tokens[:-1]
    roots = (trees.cu_num_draft_tokens[1:] - starts == 1) & ~is_greedy
    if bool(roots.any()):
        rows = roots.nonzero().squeeze(1)
        out.output_token_ids[rows, 0] = _inverse_cdf(
            target_probs[starts[rows]], randoms.uniforms[starts[rows]]
        )
    return out


def verify_reference(
    trees: PackedTrees, target_probs: torch.Tensor, is_greedy: torch.Tensor, randoms: VerifyRandoms
) -> VerifyOutput:
    """All trees walked together: each iteration tests one child per still-walking tree."""
    device, n = target_probs.device, trees.max_num_nodes
    cu = trees.cu_num_draft_tokens
    starts, sizes = cu[:-1], cu[1:] - cu[:-1]
    batch = sizes.numel()
    rows = torch.arange(batch, device=device)
    local = torch.arange(n, device=device)
    flat = (starts[:, None] + local).clamp(max=trees.token_ids.numel() - 1)  # [batch, N]
    valid = local < sizes[:, None]
    parents = torch.where(valid, trees.parents[flat], -2)  # -2 matches no node
    tokens = trees.token_ids[flat]
    uniforms = randoms.uniforms[flat]
    mode = trees.sampling
    sampled = ~is_greedy
    target_argmax = target_probs.argmax(-1)  # [total_nodes]

    node = torch.zeros(batch, dtype=torch.int64, device=device)  # current (last accepted) node
    cursor = torch.zeros_like(node)  # children tried so far have local index <= cursor
    num_accepted = torch.zeros_like(node)
    accepted = torch.full((batch, max(n - 1, 0)), -1, dtype=torch.int64, device=device)
    residual = target_probs[starts].clone()  # [batch, vocab]; r, unnormalised
    mass = residual.sum(-1)  # [batch]; S
    q_ids, q_w = _load_q(trees, starts)  # [batch, K]; working q, unnormalised
    walking = sizes > 1
    while bool(walking.any()):
        candidates = (parents == node[:, None]) & (local > cursor[:, None])
        walking &= candidates.any(-1)
        child = candidates.int().argmax(-1)  # first untried child
        x = tokens[rows, child]
        p_x = torch.where(mass > 0, residual[rows, x] / mass, 0.0)
        q_mass = q_w.sum(-1)
        q_x = torch.where(q_mass > 0, (q_w * (q_ids == x[:, None])).sum(-1) / q_mass, 0.0)
        u = uniforms[rows, child]
        accept = torch.where(
            is_greedy,
            x == target_argmax[starts + node],
            torch.where(mode == _DETERMINISTIC, u < p_x, (q_x > 0) & (u * q_x < p_x)),
        )
        reject = walking & ~accept & sampled
        accept &= walking
        cursor = torch.where(walking, child, cursor)

        det = reject & (mode == _DETERMINISTIC)
        mass = torch.where(det, mass - residual[rows, x], mass)
        residual[det, x[det]] = 0.0
        rep = (reject & (mode != _DETERMINISTIC)).nonzero().squeeze(1)
        if rep.numel():
            q_dense = torch.zeros_like(residual[rep]).scatter_add_(
                1, q_ids[rep].clamp(min=0), q_w[rep] / q_mass[rep, None]
            )
            safe_mass = torch.where(mass[rep] > 0, mass[rep], 1.0)
            residual[rep] = torch.relu(residual[rep] / safe_mass[:, None] - q_dense)
            mass[rep] = residual[rep].sum(-1)
            without = rep[mode[rep] == _WITHOUT_REPLACEMENT]
            q_w[without] = torch.where(q_ids[without] == x[without, None], 0.0, q_w[without])

        moved = accept.nonzero().squeeze(1)
        if moved.numel():
            accepted[moved, num_accepted[moved]] = child[moved]
            num_accepted[moved] += 1
            node[moved] = child[moved]
            residual[moved] = target_probs[starts[moved] + child[moved]]
            mass[moved] = residual[moved].sum(-1)
            q_ids[moved], q_w[moved] = _load_q(trees, starts[moved] + child[moved])

    # Recovered (or bonus) token: a degenerate all-zero residual falls back to p.
    source = torch.where((mass > 0)[:, None], residual, target_probs[starts + node])
    if randoms.exponentials is None:  # root-only trees: one uniform each (`draw_verify_randoms`)
        drawn = _inverse_cdf(source, randoms.uniforms[starts])
    else:
        drawn = (source / randoms.exponentials).argmax(-1)
    final = torch.where(is_greedy, target_argmax[starts + node], drawn)
    return assemble_verify_output(tokens, accepted, num_accepted, final)


def verify_roots(target_probs: torch.Tensor, is_greedy: torch.Tensor, randoms: VerifyRandoms) -> VerifyOutput:
    """Root-only trees (one node each): every output is the bonus token, drawn from p (argmax
    for greedy rows): by inverse CDF with each root's uniform, or, when the randoms carry
    exponentials, by the same exponential race as `verify_reference`."""
    greedy = int(is_greedy.sum())
    if greedy == is_greedy.numel():
        final = target_probs.argmax(-1)
    else:
        if randoms.exponentials is None:
            final = _inverse_cdf(target_probs, randoms.uniforms)
        else:
            final = (target_probs / randoms.exponentials).argmax(-1)
        if greedy:
            final = torch.where(is_greedy, target_probs.argmax(-1), final)
    batch = final.shape[0]
    return VerifyOutput(
        torch.empty(batch, 0, dtype=torch.int64, device=final.device),
        final[:, None],
        torch.ones(batch, dtype=torch.int64, device=final.device),
    )


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[B] tokens drawn from the rows of `probs` [B, V] (unnormalised) with one uniform each."""
    cdf = probs.cumsum(-1)
    drawn = torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:], right=True)[:, 0]
    return drawn.clamp_(max=probs.shape[-1] - 1)


def verify_host(
    trees: PackedTrees, target_probs: torch.Tensor, is_greedy: torch.Tensor, randoms: VerifyRandoms
) -> VerifyOutput:
    """CPU batches of a few trees (or all-greedy ones): each tree walked in Python
    (`verification_host`); the reference's result, with the same randoms."""
    greedy = is_greedy.tolist()
    sampled = not all(greedy)
    paths, finals = walk_host(
        trees,
        target_probs,
        greedy,
        randoms.uniforms.tolist() if sampled else None,
        randoms.exponentials if sampled else None,
    )
    batch, n = len(paths), trees.max_num_nodes
    tokens = trees.token_ids.tolist()
    starts = trees.cu_num_draft_tokens.tolist()
    accepted = [path + [-1] * (n - 1 - len(path)) for path in paths]
    output = [
        [tokens[start + i] for i in path] + [final] + [-1] * (n - 1 - len(path))
        for start, path, final in zip(starts, paths, finals, strict=False)
    ]
    return VerifyOutput(
        torch.tensor(accepted, dtype=torch.int64).view(batch, max(n - 1, 0)),
        torch.tensor(output, dtype=torch.int64).view(batch, n),
        torch.tensor([len(path) + 1 for path in paths], dtype=torch.int64),
    )


def _load_q(trees: PackedTrees, nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse q of flattened `nodes` [m]: ids [m, K] (-1 pad) and weights [m, K] (0 pad)."""
    row = trees.q_index[nodes]
    if trees.q_token_ids.shape[0] == 0:
        ids = torch.full((nodes.numel(), trees.q_token_ids.shape[1]), -1, device=nodes.device)
        return ids, torch.zeros(ids.shape, device=nodes.device)
    ids = torch.where((row >= 0)[:, None], trees.q_token_ids[row.clamp(min=0)], -1)
    return ids, torch.where(ids >= 0, trees.q_probs[row.clamp(min=0)], 0.0)


def assemble_verify_output(
    tokens: torch.Tensor, accepted: torch.Tensor, num_accepted: torch.Tensor, final: torch.Tensor
) -> VerifyOutput:
    """Output rows from a walk's result (the reference's and the Triton kernel's alike): the
    accepted nodes' tokens, then the final token (recovered or bonus) at `num_accepted`."""
    batch, n = tokens.shape
    output = torch.full((batch, n), -1, dtype=torch.int64, device=tokens.device)
    output[:, : n - 1] = torch.where(accepted >= 0, tokens.gather(1, accepted.clamp(min=0)), -1)
    output[torch.arange(batch, device=tokens.device), num_accepted] = final
    return VerifyOutput(accepted, output, num_accepted + 1)
