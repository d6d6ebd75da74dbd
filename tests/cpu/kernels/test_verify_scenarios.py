"""Scenario tests on hand-built target distributions (vLLM's rejection sampler tests' style)."""

import torch
from kernels_testlib import chain, concat

from outrider.kernels.packing import PackedTrees
from outrider.kernels.verification import VerifyRandoms, draw_verify_randoms, verify
from outrider.proto.tree import DraftSampling

VOCAB = 8
DET, WITH, WITHOUT = (
    DraftSampling.DETERMINISTIC,
    DraftSampling.WITH_REPLACEMENT,
    DraftSampling.WITHOUT_REPLACEMENT,
)


def one_hot_rows(tokens: list[int]) -> torch.Tensor:
    """Target probs whose argmax after node i is tokens[i]."""
    return torch.nn.functional.one_hot(torch.tensor(tokens), VOCAB).float()


def greedy(trees: PackedTrees, probs: torch.Tensor):
    return verify(trees, probs, torch.ones(trees.batch_size, dtype=torch.bool))


def fixed_randoms(uniforms: list[float], batch: int = 1, noise: torch.Tensor | None = None) -> VerifyRandoms:
    return VerifyRandoms(torch.tensor(uniforms), torch.ones(batch, VOCAB) if noise is None else noise)


def test_perfect_match_accepts_all_and_adds_a_bonus() -> None:
    out = greedy(chain([0, 1, 2, 3]), one_hot_rows([1, 2, 3, 4]))
    assert out.output_token_ids.tolist() == [[1, 2, 3, 4]]
    assert out.accepted_node_ids.tolist() == [[1, 2, 3]]
    assert out.num_output_tokens.tolist() == [4]


def test_early_mismatch_stops_with_the_target_token() -> None:
    out = greedy(chain([0, 1, 5, 3]), one_hot_rows([1, 2, 3, 4]))
    assert out.output_token_ids.tolist() == [[1, 2, -1, -1]]
    assert out.accepted_node_ids.tolist() == [[1, -1, -1]]
    assert out.num_output_tokens.tolist() == [2]


def test_all_rejected_sampled_chain_recovers_from_the_residual() -> None:
    # p puts no mass on the drafted tokens: every draw is rejected at the first node.
    p = torch.zeros(3, VOCAB)
    p[:, 6:] = 0.5
    q = torch.zeros(2, VOCAB)
    q[:, :2] = 0.5
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        randoms = draw_verify_randoms(torch.tensor([0, 3]), VOCAB, gen)
        out = verify(chain([0, 0, 1], q), p, torch.tensor([False]), randoms)
        assert out.num_output_tokens.tolist() == [1]
        assert out.output_token_ids[0, 0].item() in (6, 7)


def test_empty_tree_emits_one_bonus_token() -> None:
    p = one_hot_rows([5])
    assert greedy(chain([3]), p).output_token_ids.tolist() == [[5]]
    sampled = verify(chain([3]), p, torch.tensor([False]), fixed_randoms([0.3]))
    assert sampled.output_token_ids.tolist() == [[5]]
    assert sampled.accepted_node_ids.shape == (1, 0)


def test_single_draft_node_accepted_or_rejected_by_its_uniform() -> None:
    p = torch.tensor([[0.0, 0.6, 0.4] + [0.0] * 5, [0.0] * 7 + [1.0]])
    q = torch.tensor([[0.0, 1.0] + [0.0] * 6])
    accept = verify(chain([0, 1], q), p, torch.tensor([False]), fixed_randoms([0.0, 0.59]))
    assert accept.output_token_ids.tolist() == [[1, 7]]
    reject = verify(chain([0, 1], q), p, torch.tensor([False]), fixed_randoms([0.0, 0.61]))
    assert reject.output_token_ids.tolist() == [[2, -1]]  # residual max(0, p - q) = token 2 only


def test_deep_chain_is_fully_accepted() -> None:
    tokens = [i % VOCAB for i in range(17)]
    out = greedy(chain(tokens), one_hot_rows(tokens[1:] + [3]))
    assert out.num_output_tokens.tolist() == [17]
    assert out.output_token_ids[0].tolist() == tokens[1:] + [3]


def wide_tree(tokens: list[int], mode=DET) -> PackedTrees:
    """Root with len(tokens) - 1 children."""
    n = len(tokens)
    return PackedTrees(
        token_ids=torch.tensor(tokens),
        parents=torch.tensor([-1] + [0] * (n - 1)),
        cu_num_draft_tokens=torch.tensor([0, n]),
        sampling=torch.tensor([int(mode)]),
        q_index=torch.tensor([0] + [-1] * (n - 1)),
        q_token_ids=torch.arange(VOCAB)[None],
        q_probs=torch.full((1, VOCAB), 1.0 / VOCAB),
        max_num_nodes=n,
    )


def test_wide_tree_follows_the_matching_child() -> None:
    tree = wide_tree([0, 1, 2, 3, 4, 5, 6, 7])
    out = greedy(tree, one_hot_rows([6, 0, 0, 0, 0, 0, 2, 0]))
    assert out.accepted_node_ids.tolist() == [[6] + [-1] * 6]
    assert out.output_token_ids[0, :2].tolist() == [6, 2]


def test_duplicate_sibling_tokens_are_not_accepted_twice() -> None:
    # Deterministic: the first sibling 3 is rejected (u = 0.9 >= p(3) = 0.5), then p(3) is
    # zeroed, so the duplicate cannot be accepted whatever its uniform.
    p = torch.zeros(3, VOCAB)
    p[0, 3], p[0, 4] = 0.5, 0.5
    out = verify(wide_tree([0, 3, 3]), p, torch.tensor([False]), fixed_randoms([0.0, 0.9, 0.0]))
    assert out.output_token_ids.tolist() == [[4, -1, -1]]
    # Greedy: the first matching sibling wins.
    out = greedy(wide_tree([0, 3, 3]), one_hot_rows([3, 1, 2]))
    assert out.accepted_node_ids.tolist() == [[1, -1]]


def test_batch_mixing_greedy_and_sampled_matches_each_alone() -> None:
    gen = torch.Generator().manual_seed(3)
    parts = [chain([0, 1, 2]), wide_tree([0, 1, 2, 3], WITH), chain([4]), wide_tree([1, 2, 2], WITHOUT)]
    probs = [torch.rand(t.token_ids.numel(), VOCAB, generator=gen).softmax(-1) for t in parts]
    is_greedy = [True, False, True, False]
    batch = concat(parts)
    randoms = draw_verify_randoms(batch.cu_num_draft_tokens, VOCAB, gen)
    together = verify(batch, torch.cat(probs), torch.tensor(is_greedy), randoms)
    starts = batch.cu_num_draft_tokens.tolist()
    for i, (tree, p) in enumerate(zip(parts, probs, strict=True)):
        own = VerifyRandoms(randoms.uniforms[starts[i] : starts[i + 1]], randoms.exponentials[i : i + 1])
        alone = verify(tree, p, torch.tensor([is_greedy[i]]), own)
        n = tree.max_num_nodes
        assert together.output_token_ids[i, :n].tolist() == alone.output_token_ids[0].tolist()
        assert together.num_output_tokens[i] == alone.num_output_tokens[0]


def test_per_request_generators_reproduce_a_request_in_any_batch() -> None:
    trees = concat([wide_tree([0, 1, 2, 3], WITH), wide_tree([0, 1, 2, 3], WITH)])
    p = torch.rand(8, VOCAB, generator=torch.Generator().manual_seed(0)).softmax(-1)
    is_greedy = torch.tensor([False, False])

    def run(seeds: list[int]) -> list[int]:
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        randoms = draw_verify_randoms(trees.cu_num_draft_tokens, VOCAB, gens)
        return verify(trees, p, is_greedy, randoms).output_token_ids[0].tolist()

    assert run([11, 1]) == run([11, 2])
    assert {tuple(run([s, 0])) for s in range(30)} != {tuple(run([0, 0]))}
