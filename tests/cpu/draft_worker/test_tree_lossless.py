"""Lossless end to end at the kernel level: builder trees, verified by `kernels.verify`.

NUM_DRAWS sequences share one root; the bigram proposer drafts a sampled tree for each (one
batched build), `kernels.verify` walks them against a target bigram p processed with the same
temperature/top-p, and the first output token must follow p[root] whatever the tree, since
every drafted child is a fresh draw from the q row sent with it. TV bound as in
tests/cpu/kernels/test_verify_lossless.py: with n draws over m cells, TV < sqrt(2 (m ln 2 +
ln(1 / delta)) / n) / 2 with probability 1 - delta.
"""

import math

import pytest
import torch
from draft_testlib import VOCAB, bigram_table

from outrider.draft_worker import build_proposer
from outrider.kernels import draw_verify_randoms, pack_trees, process_logits, verify
from outrider.proto import DraftSampling, SamplingParams, SequenceUpdate, TreeBudget
from outrider.target_worker.draft_trust import DraftTrust

NUM_DRAWS = 20_000
DELTA = 1e-6
ROOT = 3
TEMPERATURE, TOP_P = 0.9, 0.9


def tv_bound(cells: int) -> float:
    return math.sqrt(2 * (cells * math.log(2) + math.log(1 / DELTA)) / NUM_DRAWS) / 2


@pytest.mark.parametrize("trusted", [True, False], ids=["draft_q", "demoted"])
@pytest.mark.parametrize("mode", ["with_replacement", "without_replacement", "deterministic"])
def test_first_token_follows_the_target(mode, trusted):
    """Both ways a target verifies drafts (`draft_trust`): with the drafter's q, and demoted to
    deterministic proposals; a trusted drafter's q also passes the audit."""
    torch.manual_seed(1)
    config = {"method": "test_bigram", "num_speculative_tokens": 3, "tree_top_k": 3, "tree_max_nodes": 8}
    proposer = build_proposer(config | {"draft_sampling": mode}, vocab_size=VOCAB)
    # A target that agrees with the draft only in part, so residuals matter.
    target_logits = proposer.table + bigram_table(seed=9, scale=1.0)
    ones = torch.ones(VOCAB)
    p = process_logits(target_logits, ones * TEMPERATURE, None, ones * TOP_P)  # [VOCAB, VOCAB]

    sampling = SamplingParams(temperature=TEMPERATURE, top_p=TOP_P)
    budget = TreeBudget(max_nodes=8, max_depth=3, top_k=3)
    updates = [SequenceUpdate(i, 0, torch.tensor([ROOT]), sampling, budget) for i in range(NUM_DRAWS)]
    trees = proposer.propose(updates)
    assert trees[0].sampling == DraftSampling[mode.upper()] and trees[0].num_nodes == 8

    trust = DraftTrust(trusted)
    packed = pack_trees(trust.prepare(trees))
    randoms = draw_verify_randoms(packed.cu_num_draft_tokens, VOCAB, torch.Generator().manual_seed(2))
    is_greedy = torch.zeros(NUM_DRAWS, dtype=torch.bool)
    out = verify(packed, p[packed.token_ids], is_greedy, randoms, backend="torch")
    trust.audit(packed, p[packed.token_ids], is_greedy)
    assert trust.uses_q == trusted  # an honest drafter keeps its trust
    first = torch.bincount(out.output_token_ids[:, 0], minlength=VOCAB).double() / NUM_DRAWS
    assert 0.5 * float((first - p[ROOT]).abs().sum()) < tv_bound(VOCAB)
    assert float(out.num_accepted.float().mean()) > 0.5  # deep enough to exercise residuals
