"""pack_trees flattens proto candidate trees into the verifier's ragged batch."""

import torch

from outrider.kernels.packing import pack_trees
from outrider.proto.tree import CandidateTree, DraftSampling


def test_pack_trees_offsets_q_rows_and_padding() -> None:
    a = CandidateTree(
        seq_id=1,
        round=0,
        tokens=torch.tensor([5, 6, 7]),
        parents=torch.tensor([-1, 0, 0]),
        q_nodes=torch.tensor([0]),
        q_token_ids=torch.tensor([[6, 7]]),
        q_probs=torch.tensor([[0.5, 0.4]]),
        sampling=DraftSampling.WITH_REPLACEMENT,
    )
    b = CandidateTree(
        seq_id=2,
        round=0,
        tokens=torch.tensor([1, 2, 3]),
        parents=torch.tensor([-1, 0, 1]),
        q_nodes=torch.tensor([0, 1]),
        q_token_ids=torch.tensor([[2, 4, 9], [3, -1, -1]]),
        q_probs=torch.tensor([[0.3, 0.3, 0.3], [1.0, 0.0, 0.0]]),
        sampling=DraftSampling.WITHOUT_REPLACEMENT,
    )
    packed = pack_trees([a, b])
    assert packed.cu_num_draft_tokens.tolist() == [0, 3, 6]
    assert packed.token_ids.tolist() == [5, 6, 7, 1, 2, 3]
    assert packed.q_index.tolist() == [0, -1, -1, 1, 2, -1]
    assert packed.q_token_ids.tolist() == [[6, 7, -1], [2, 4, 9], [3, -1, -1]]
    assert packed.sampling.tolist() == [1, 2]
    assert packed.max_num_nodes == 3
