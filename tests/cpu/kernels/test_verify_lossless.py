"""Statistical losslessness: sampled verification reproduces the target's distribution.

Toy Markov target p and draft q over VOCAB tokens (kernels_testlib). For each case,
NUM_DRAWS sequences start at the same root, are drafted and verified in one batched call,
and sequences that output a single token get a second round rooted at it, so every sequence
yields its first two generated tokens (t1, t2), whose exact law is p[root, t1] * p[t1, t2].

Bound: for m cells and n i.i.d. draws, P(||p_hat - p||_1 >= eps) <= (2^m - 2) exp(-n eps^2 / 2)
(Weissman et al. 2003), so with failure probability DELTA the total-variation distance
TV = ||.||_1 / 2 stays below sqrt(2 (m ln 2 + ln(1 / DELTA)) / n) / 2. With n = 100k and
DELTA = 1e-6: about 0.0095 for the first token (m = 6) and 0.014 for the pair (m = 36).
"""

import math

import pytest
import torch
from kernels_testlib import draft_trees

from outrider.kernels.logits_processing import process_logits
from outrider.kernels.verification import VerifyOutput, draw_verify_randoms, verify
from outrider.proto.tree import DraftSampling

VOCAB = 6
NUM_DRAWS = 100_000
DELTA = 1e-6
ROOT = 0


def tv_bound(cells: int, draws: int = NUM_DRAWS, delta: float = DELTA) -> float:
    return math.sqrt(2 * (cells * math.log(2) + math.log(1 / delta)) / draws) / 2


def toy_tables(truncation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft next-token tables, both after the same temperature/top-k/top-p."""
    gen = torch.Generator().manual_seed(7)
    target_logits = torch.randn(VOCAB, VOCAB, generator=gen) * 1.5
    # A draft that disagrees with the target a lot, so residuals matter.
    draft_logits = target_logits.flip(1) * 0.5 + torch.randn(VOCAB, VOCAB, generator=gen)
    ones = torch.ones(VOCAB)
    top_k = torch.full((VOCAB,), 4) if truncation == "top_k" else None
    top_p = torch.full((VOCAB,), 0.8) if truncation == "top_p" else None
    p = process_logits(target_logits, ones * 0.9, top_k, top_p)
    q = process_logits(draft_logits, ones * 0.9, top_k, top_p)
    return p, q


def sample_two_tokens(
    p: torch.Tensor, q: torch.Tensor, branching: list[int], drafted: DraftSampling, verified: DraftSampling
) -> tuple[torch.Tensor, torch.Tensor]:
    """First two generated tokens of NUM_DRAWS sequences; `verified` may lie about the drafts."""
    gen = torch.Generator().manual_seed(1234)

    def one_round(roots: torch.Tensor) -> VerifyOutput:
        trees = draft_trees(roots, q, branching, drafted, gen, q_scale=0.7)
        trees.sampling.fill_(int(verified))
        randoms = draw_verify_randoms(trees.cu_num_draft_tokens, VOCAB, gen)
        is_greedy = torch.zeros(roots.numel(), dtype=torch.bool)
        return verify(trees, p[trees.token_ids], is_greedy, randoms, backend="torch")

    first = one_round(torch.full((NUM_DRAWS,), ROOT))
    t1 = first.output_token_ids[:, 0]
    t2 = first.output_token_ids[:, 1].clone()
    short = first.num_output_tokens == 1
    t2[short] = one_round(t1[short]).output_token_ids[:, 0]
    return t1, t2


def tv_distances(p: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor) -> tuple[float, float]:
    expected_first = p[ROOT]
    expected_pair = (expected_first[:, None] * p).reshape(-1)
    first = torch.bincount(t1, minlength=VOCAB).double() / t1.numel()
    pair = torch.bincount(t1 * VOCAB + t2, minlength=VOCAB * VOCAB).double() / t1.numel()
    return (
        0.5 * float((first - expected_first).abs().sum()),
        0.5 * float((pair - expected_pair).abs().sum()),
    )


MODES = [DraftSampling.DETERMINISTIC, DraftSampling.WITH_REPLACEMENT, DraftSampling.WITHOUT_REPLACEMENT]
SHAPES = {"chain": [1, 1, 1], "tree": [3, 2]}


@pytest.mark.parametrize("truncation", ["none", "top_k", "top_p"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name.lower())
def test_first_two_tokens_follow_target(mode: DraftSampling, shape: str, truncation: str) -> None:
    p, q = toy_tables(truncation)
    branching = SHAPES[shape]
    if mode == DraftSampling.WITHOUT_REPLACEMENT and truncation != "none":
        branching = [min(k, 2) for k in branching]  # top-p may leave only two tokens in q's support
    t1, t2 = sample_two_tokens(p, q, branching, mode, mode)
    tv_first, tv_pair = tv_distances(p, t1, t2)
    assert tv_first < tv_bound(VOCAB), (tv_first, tv_bound(VOCAB))
    assert tv_pair < tv_bound(VOCAB * VOCAB), (tv_pair, tv_bound(VOCAB * VOCAB))


def test_check_catches_a_residual_that_ignores_the_current_siblings_q() -> None:
    """Children drawn without replacement but verified with the i.i.d. residual relu(p - q):
    it keeps subtracting the original q instead of q with the rejected siblings removed."""
    p, q = toy_tables("none")
    t1, t2 = sample_two_tokens(
        p, q, [3, 2], DraftSampling.WITHOUT_REPLACEMENT, DraftSampling.WITH_REPLACEMENT
    )
    tv_first, tv_pair = tv_distances(p, t1, t2)
    assert tv_first > 2 * tv_bound(VOCAB) and tv_pair > 2 * tv_bound(VOCAB * VOCAB), (tv_first, tv_pair)


def test_bound_matches_the_documented_figures() -> None:
    assert tv_bound(VOCAB) == pytest.approx(0.0095, abs=5e-4)
    assert tv_bound(VOCAB * VOCAB) == pytest.approx(0.0139, abs=5e-4)


@pytest.mark.parametrize("drafted", MODES[1:], ids=lambda m: m.name.lower())
def test_sampled_drafts_verified_as_deterministic_proposals_follow_target(drafted: DraftSampling) -> None:
    """An untrusted drafter's trees are demoted (`target_worker.draft_trust`): children drawn
    from q (repeats and all) but tested with u < r(x) / S, never with the q that came along."""
    p, q = toy_tables("none")
    t1, t2 = sample_two_tokens(p, q, [3, 2], drafted, DraftSampling.DETERMINISTIC)
    tv_first, tv_pair = tv_distances(p, t1, t2)
    assert tv_first < tv_bound(VOCAB) and tv_pair < tv_bound(VOCAB * VOCAB), (tv_first, tv_pair)


def chosen_token_first_outputs(verified_as: DraftSampling, chosen: int) -> torch.Tensor:
    """First output tokens when every tree is root -> `chosen` -> `chosen`, sent with a q row
    that claims chosen has probability 1e-6: the lying drafter of docs/algorithms.md section 2b."""
    p, _ = toy_tables("none")
    claim = torch.full((VOCAB,), (1 - 1e-6) / (VOCAB - 1))
    claim[chosen] = 1e-6
    lying_q = claim.expand(VOCAB, VOCAB).contiguous()
    one_hot = torch.zeros(VOCAB, VOCAB)
    one_hot[:, chosen] = 1.0
    gen = torch.Generator().manual_seed(99)
    trees = draft_trees(torch.full((NUM_DRAWS,), ROOT), one_hot, [1, 1], DraftSampling.WITH_REPLACEMENT, gen)
    trees.q_probs = lying_q[trees.token_ids[trees.q_index >= 0]]
    trees.sampling.fill_(int(verified_as))
    randoms = draw_verify_randoms(trees.cu_num_draft_tokens, VOCAB, gen)
    out = verify(
        trees, p[trees.token_ids], torch.zeros(NUM_DRAWS, dtype=torch.bool), randoms, backend="torch"
    )
    return out.output_token_ids[:, 0]


def test_a_drafter_choosing_tokens_cannot_steer_a_deterministic_verifier() -> None:
    p, _ = toy_tables("none")
    chosen = int(p[ROOT].argmin())
    trusted = torch.bincount(
        chosen_token_first_outputs(DraftSampling.WITH_REPLACEMENT, chosen), minlength=VOCAB
    )
    demoted = torch.bincount(chosen_token_first_outputs(DraftSampling.DETERMINISTIC, chosen), minlength=VOCAB)
    # With its q believed, the chosen token (the target's least likely) is nearly always output.
    assert float(trusted[chosen]) / NUM_DRAWS > 0.99 > 10 * float(p[ROOT, chosen])
    tv = 0.5 * float((demoted.double() / NUM_DRAWS - p[ROOT]).abs().sum())
    assert tv < tv_bound(VOCAB), tv
