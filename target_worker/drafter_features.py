"""The target features a drafter asks for: what the runner captures, and what each sequence keeps.

Features for the drafter (`FeatureSpec.layer_ids`, the inputs of those target layers,
concatenated) follow the convention that row j of an update's `features` is the target
hidden state at the position *before* new_tokens[j], the state that predicted it (EAGLE's
f_i pairs with t_(i+1)); position 0 has none and gets a zero row.

    forward rows of a verified sequence:  [prompt chunk ..] root  n1  n2  n3   (tree: root, n1..n3)
    path root -> n2 -> n3 accepted, bonus b:  tokens n2, n3, b are appended
    rows kept:                            [prompt chunk ..] root      n2  n3   (each predicted the next)

The engine captures one set per round for every sequence in the forward; each sequence keeps
its rows in `Sequence.unsent_features` until its next update carries them to the drafter.
"""

from __future__ import annotations

import torch

from outrider.proto import FeatureSpec
from outrider.target_worker.batch import ForwardOutput, HiddenCapture
from outrider.target_worker.sequence import Sequence


def capture_for(features: FeatureSpec, num_layers: int) -> HiddenCapture | None:
    """What the runner returns for a drafter's FeatureSpec; layer id `num_layers` = final hidden."""
    if not features.needs_features:
        return None
    beyond = [i for i in features.layer_ids if i > num_layers]
    if beyond:
        raise ValueError(
            f"the drafter wants features of layers {beyond}; the target has {num_layers} "
            f"(layer {num_layers} = the final hidden state)"
        )
    inputs = tuple(i for i in features.layer_ids if i < num_layers)
    return HiddenCapture(layer_inputs=inputs, final=num_layers in features.layer_ids)


def gather_features(out: ForwardOutput, features: FeatureSpec, num_layers: int) -> torch.Tensor:
    """[T, len(layer_ids) * H] raw drafter features of every token in the forward.

    Always the raw concatenation: with a `projected` spec the draft source applies the
    drafter's fc itself (`draft_source.project_features`) before the features leave.
    """
    layers = [out.final_hidden if i == num_layers else out.layer_inputs[i] for i in features.layer_ids]
    return torch.cat(layers, dim=-1).to(getattr(torch, features.dtype))


def verified_rows(
    chunk_start: int, chunk_end: int, tree_size: int, accepted: list[int], num_output: int
) -> list[int]:
    """Forward rows that predicted each new token of a verified sequence.

    Prompt chunk rows before the root, the root, then the accepted nodes (all but the last
    new token's predecessor). A tree (or chain) is the chunk's last rows: a prompt chunk
    ends in its root.
    """
    root = chunk_end - tree_size
    path = [root + node for node in accepted[: num_output - 1]]
    return [*range(chunk_start, root + 1), *path]


def keep_features(seq: Sequence, rows: torch.Tensor) -> None:
    """Holds `rows` for the sequence's next update."""
    if seq.num_cached == 0:  # the first token has no predecessor: a zero row
        seq.unsent_features.append(rows.new_zeros(1, rows.shape[1]))
    seq.unsent_features.append(rows)
