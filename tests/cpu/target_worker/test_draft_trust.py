"""Whose q the verifier uses (`target_worker.draft_trust`): demotion, the audit, derived seeds.

Scenario tests on hand-built trees, and the audit's two sides on toy tables: an honest
drafter (children drawn from the q it sends) is never revoked, a drafter that understates q
is, within a few rounds when the lie is large.
"""

import math

import pytest
import torch

from outrider.kernels import pack_trees
from outrider.proto import CandidateTree, DraftSampling, TreeBudget, check_trees
from outrider.target_worker.draft_trust import (
    DraftTrust,
    VerificationMode,
    demote,
    derive_seed,
    importance_ratios,
)

VOCAB = 16


def tree(tokens, parents, q_nodes=(), q_ids=(), q_probs=(), sampling=DraftSampling.WITH_REPLACEMENT):
    width = len(q_ids[0]) if q_ids else 1
    return CandidateTree(
        seq_id=0,
        round=1,
        tokens=torch.tensor(tokens),
        parents=torch.tensor(parents),
        q_nodes=torch.tensor(list(q_nodes), dtype=torch.int64),
        q_token_ids=torch.tensor(list(q_ids), dtype=torch.int64).reshape(-1, width),
        q_probs=torch.tensor(list(q_probs), dtype=torch.float32).reshape(-1, width),
        sampling=sampling,
    )


def test_demote_prunes_a_repeated_sibling_with_its_subtree_and_keeps_the_q_rows():
    #  root -> 5 (node 1) -> 7 (node 3)
    #       -> 5 (node 2, a repeat) -> 9, 8 (nodes 4, 5: go with it)
    sent = tree(
        [1, 5, 5, 7, 9, 8],
        [-1, 0, 0, 1, 2, 2],
        q_nodes=[0, 1, 2],
        q_ids=[[5, 6], [7, 8], [9, 8]],
        q_probs=[[0.5, 0.5], [0.9, 0.1], [0.6, 0.4]],
    )
    out = demote(sent)
    assert out.sampling == DraftSampling.DETERMINISTIC
    assert out.tokens.tolist() == [1, 5, 7] and out.parents.tolist() == [-1, 0, 1]
    assert out.q_nodes.tolist() == [0, 1]
    assert out.q_token_ids.tolist() == [[5, 6], [7, 8]]
    assert check_trees([out], [TreeBudget(8, 4, 2)], VOCAB) == [None]


def test_demote_keeps_distinct_trees_whole():
    sent = tree(
        [1, 5, 6, 7], [-1, 0, 0, 2], q_nodes=[0, 2], q_ids=[[5, 6], [7, 0]], q_probs=[[0.5, 0.5], [1, 0]]
    )
    out = demote(sent)
    assert out.tokens.tolist() == [1, 5, 6, 7] and out.q_nodes.tolist() == [0, 2]
    assert out.sampling == DraftSampling.DETERMINISTIC


@pytest.mark.parametrize("trusted", [False, True])
def test_only_a_trusted_source_keeps_the_drafters_sampling_mode(trusted):
    trust = DraftTrust(trusted)
    sent = tree([1, 5, 5], [-1, 0, 0], q_nodes=[0], q_ids=[[5, 6]], q_probs=[[0.5, 0.5]])
    (out,) = trust.prepare([sent])
    if trusted:
        assert out is sent and trust.mode == VerificationMode.DRAFT_Q
    else:
        assert out.sampling == DraftSampling.DETERMINISTIC and out.num_nodes == 2
        assert trust.mode == VerificationMode.DETERMINISTIC
        assert (trust.demoted_trees, trust.pruned_repeats) == (1, 1)


def test_importance_ratios_by_hand():
    # Tree 0 (sampled): root's children a=3 (first), b=4 under q {3: .2, 4: .6, 5: .2} sent at
    # half scale (renormalised); node 1 (a) has child 6 under q {6: 1}. Tree 1 is greedy and
    # tree 2 deterministic: neither is audited.
    sampled = tree(
        [0, 3, 4, 6],
        [-1, 0, 0, 1],
        q_nodes=[0, 1],
        q_ids=[[3, 4, 5], [6, -1, -1]],
        q_probs=[[0.1, 0.3, 0.1], [1.0, 0.0, 0.0]],
    )
    greedy = tree([0, 3], [-1, 0], q_nodes=[0], q_ids=[[3]], q_probs=[[1.0]])
    det = tree([0, 3], [-1, 0], sampling=DraftSampling.DETERMINISTIC)
    packed = pack_trees([sampled, greedy, det])
    p = torch.full((packed.token_ids.numel(), VOCAB), 0.0)
    p[0, 3], p[0, 4], p[0, 0] = 0.4, 0.1, 0.5  # p after the root of tree 0
    p[1, 6], p[1, 0] = 0.3, 0.7  # p after node a
    p[4:] = 1.0 / VOCAB
    audited = torch.tensor([True, False, False])
    ratios = importance_ratios(packed, p, audited)
    assert ratios.tolist() == pytest.approx([0.4 / 0.2, 0.3 / 1.0])


def toy_round(p_table, q_table, roots, gen, understate: float = 1.0):
    """One round of depth-2 sampled trees (2 children of the root, 1 under the first),
    drawn from q; `understate` < 1 makes the drafter report q(x) * understate for what it drew."""
    trees = []
    for root in roots.tolist():
        a, b = torch.multinomial(q_table[root], 2, replacement=True, generator=gen).tolist()
        (c,) = torch.multinomial(q_table[a], 1, generator=gen).tolist()
        rows = [q_table[root].clone(), q_table[a].clone()]
        rows[0][a] *= understate
        rows[1][c] *= understate
        trees.append(
            tree(
                [root, a, b, c],
                [-1, 0, 0, 1],
                q_nodes=[0, 1],
                q_ids=[list(range(VOCAB))] * 2,
                q_probs=[r.tolist() for r in rows],
            )
        )
    packed = pack_trees(trees)
    return packed, p_table[packed.token_ids]


def tables(seed: int, agreement: float = 0.0):
    """Target p and draft q tables; `agreement` 0 = an unrelated drafter, near 1 = a good one."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(VOCAB, VOCAB, generator=gen) * 2
    noise = torch.randn(VOCAB, VOCAB, generator=gen) * 2
    p = torch.softmax(logits, -1)
    q = torch.softmax(agreement * logits + (1 - agreement) * noise, -1)
    return p, q, gen


@pytest.mark.parametrize("agreement", [0.0, 0.8])
def test_the_audit_never_revokes_an_honest_drafter(agreement):
    p, q, gen = tables(0, agreement)
    trust = DraftTrust(True)
    greedy = torch.zeros(32, dtype=torch.bool)
    for _ in range(500):
        packed, probs = toy_round(p, q, torch.randint(0, VOCAB, (32,), generator=gen), gen)
        trust.audit(packed, probs, greedy)
    assert trust.mode == VerificationMode.DRAFT_Q
    assert trust.audited_children == 500 * 32 * 2
    assert trust.mean_ratio <= 1.0 + 0.05  # sum of p over q's support, on average


def test_the_audit_revokes_a_good_drafter_that_understates_q():
    p, q, gen = tables(1, agreement=0.8)
    trust = DraftTrust(True)
    greedy = torch.zeros(32, dtype=torch.bool)
    rounds = 0
    while trust.uses_q and rounds < 200:
        packed, probs = toy_round(p, q, torch.randint(0, VOCAB, (32,), generator=gen), gen, understate=0.25)
        trust.audit(packed, probs, greedy)
        rounds += 1
    assert trust.mode == VerificationMode.REVOKED and rounds < 20
    assert trust.prepare([tree([1, 5], [-1, 0], q_nodes=[0], q_ids=[[5]], q_probs=[[1.0]])])[0].sampling == (
        DraftSampling.DETERMINISTIC
    )


def test_a_blatant_liar_is_revoked_in_its_first_rounds():
    p, _, _ = tables(2)
    trust = DraftTrust(True)
    liar = tree([1, 7], [-1, 0], q_nodes=[0], q_ids=[[7, 8]], q_probs=[[1e-6, 1 - 1e-6]])
    packed = pack_trees([liar] * 4)
    for _ in range(2):
        trust.audit(packed, p[packed.token_ids], torch.zeros(4, dtype=torch.bool))
    assert trust.mode == VerificationMode.REVOKED and trust.audited_rounds <= 2


def test_an_unaudited_trust_is_never_revoked():
    p, _, _ = tables(2)
    trust = DraftTrust(True, auditing=False)
    liar = pack_trees([tree([1, 7], [-1, 0], q_nodes=[0], q_ids=[[7, 8]], q_probs=[[1e-6, 1 - 1e-6]])])
    for _ in range(5):
        trust.audit(liar, p[liar.token_ids], torch.zeros(1, dtype=torch.bool))
    assert trust.uses_q and trust.log_wealth > math.log(1e6)


def test_derived_seeds_depend_on_purpose_and_key():
    key, other = b"k" * 32, b"o" * 32
    verify, draft = derive_seed(key, 42, "verify"), derive_seed(key, 42, "draft")
    assert verify != draft != 42
    assert derive_seed(key, 42, "verify") == verify  # reproducible
    assert derive_seed(other, 42, "verify") != verify
    assert 0 <= verify < 2**63 and 0 <= draft < 2**63
