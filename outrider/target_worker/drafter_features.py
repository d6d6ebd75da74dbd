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
A round's work is kept to what a sequence held back by the policy needs (one such round per
token it decodes): rows stay in the model's dtype, and a sequence's rows are a view of the
round's tensor when they are most of it (a batch-1 decode: no copy at all); the concatenation
and the cast to the drafter's dtype happen once, when an update is sent (`features_to_send`).
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


class RoundFeatures:
    """A round's captured layers, each [T, H] in the model's dtype; joined into one
    [T, len(layers) * H] tensor only when some sequence needs a copy of its rows."""

    __slots__ = ("layers", "_joined")

    def __init__(self, layers: tuple[torch.Tensor, ...]):
        self.layers, self._joined = layers, None

    def joined(self) -> torch.Tensor:
        if self._joined is None:
            self._joined = self.layers[0] if len(self.layers) == 1 else torch.cat(self.layers, dim=-1)
        return self._joined


def gather_features(out: ForwardOutput, features: FeatureSpec, num_layers: int) -> RoundFeatures:
    """The raw drafter features of every token in the forward (no copy; joined and cast when a
    sequence's rows are sent: `features_to_send`).

    Always the raw concatenation: with a `projected` spec the draft source applies the
    drafter's fc itself (`draft_source.project_features`) before the features leave.
    """
    return RoundFeatures(
        tuple(out.final_hidden if i == num_layers else out.layer_inputs[i] for i in features.layer_ids)
    )


def verified_rows(
    chunk_start: int, chunk_end: int, tree_size: int, accepted: list[int], num_output: int
) -> slice | list[int]:
    """Forward rows that predicted each new token of a verified sequence.

    Prompt chunk rows before the root, the root, then the accepted nodes (all but the last
    new token's predecessor). A tree (or chain) is the chunk's last rows: a prompt chunk
    ends in its root. A chain's accepted nodes 1, 2, .. follow the root: one slice.
    """
    root = chunk_end - tree_size
    path = accepted[: num_output - 1]
    if all(node == i for i, node in enumerate(path, start=1)):
        return slice(chunk_start, root + 1 + len(path))
    return [*range(chunk_start, root + 1), *(root + node for node in path)]


# Held rows entries a sequence keeps before joining them (a cap on the list, and on the work
# of its next send: joining 1024 entries is ~1 ms here; the memory views keep alive is bounded
# by `keep_features`' half rule). A join copies what is held, so it is rare: at 64, a
# sequence the policy held back for ~600 rounds spent ~6 us a round re-joining its rows.
MAX_HELD_TENSORS = 1024


def keep_features(seq: Sequence, features: RoundFeatures, rows: slice | list[int]) -> None:
    """Holds the round's `rows` of `features` for the sequence's next update.

    The round's layers themselves when the rows are all of them (a batch-1 decode: no torch
    op at all, in the rounds a sequence held back by the policy spends most of its life in);
    views of each layer when the rows are at least half the round's; else a copy of the
    joined rows, so a held sequence does not keep a big round's tensors alive (what views
    hold is at most twice the sequence's own rows). Past MAX_HELD_TENSORS the held rows are
    joined into one tensor (a copy).
    """
    layers = features.layers
    if rows.__class__ is not slice:
        kept = features.joined()[rows]  # a list index copies
    elif rows.start == 0 and rows.stop == layers[0].shape[0]:
        kept = layers if len(layers) > 1 else layers[0]
    elif 2 * (rows.stop - rows.start) >= layers[0].shape[0]:
        kept = layers[0][rows] if len(layers) == 1 else tuple(layer[rows] for layer in layers)
    else:
        kept = features.joined()[rows].clone()
    held = seq.unsent_features
    if seq.num_cached == 0:  # the first token has no predecessor: a zero row
        held.append(layers[0].new_zeros(1, sum(layer.shape[1] for layer in layers)))
    held.append(kept)
    if len(held) > MAX_HELD_TENSORS:
        seq.unsent_features = [_join_held(held)]


def _join_held(held: list[torch.Tensor | tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """The held rows as one [n, width] tensor: runs of per-layer views are joined layer by
    layer (one cat per layer, not one per round), then the pieces in order."""
    pieces, run = [], []
    for rows in held:
        if isinstance(rows, tuple):
            run.append(rows)
            continue
        if run:
            pieces.append(_join_run(run))
            run = []
        pieces.append(rows)
    if run:
        pieces.append(_join_run(run))
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _join_run(run: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    return torch.cat(
        [torch.cat(layer) if len(layer) > 1 else layer[0] for layer in zip(*run, strict=True)], dim=-1
    )


def features_to_send(seq: Sequence, features: FeatureSpec) -> torch.Tensor:
    """The rows a sequence holds, as one [n, width] tensor in the drafter's dtype (a copy)."""
    joined = _join_held(seq.unsent_features)
    return joined.to(getattr(torch, features.dtype), copy=True)
