"""vLLM-shaped speculative decoding counters."""

import torch

from outrider.kernels.spec_metrics import SpecDecodeCounters
from outrider.kernels.verification import VerifyOutput


def output(num_output: list[int]) -> VerifyOutput:
    n = max(num_output)
    return VerifyOutput(
        torch.empty(len(num_output), n - 1), torch.empty(len(num_output), n), torch.tensor(num_output)
    )


def test_counters_from_a_verify_step() -> None:
    counters = SpecDecodeCounters()
    # Trees of 5, 4, 1 (root only: not a draft) and 3 nodes; 3, 1, 1, 2 output tokens.
    counters.observe(torch.tensor([0, 5, 9, 10, 13]), output([3, 1, 1, 2]))
    assert counters.num_drafts == 3
    assert counters.num_draft_tokens == 4 + 3 + 2
    assert counters.num_accepted_tokens == 2 + 0 + 1
    assert counters.num_accepted_tokens_per_pos == [2, 1]
    assert counters.mean_acceptance_length == 1 + 3 / 3
    assert counters.acceptance_rate == 3 / 9


def test_merge_adds_and_grows_positions() -> None:
    a, b = SpecDecodeCounters(), SpecDecodeCounters()
    a.observe(torch.tensor([0, 3, 6]), output([2, 1]))
    b.observe(torch.tensor([0, 4, 8]), output([4, 2]))
    a.merge(b)
    assert (a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens) == (4, 10, 5)
    assert a.num_accepted_tokens_per_pos == [3, 1, 1]
