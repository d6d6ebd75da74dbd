"""P-EAGLE training with COD sampling (arXiv 2602.01469; docs/algorithms.md section 4).

    outrider train-draft --method peagle --target DIR --out DIR --steps 600

Depth 0 is the ordinary EAGLE-3 row (t_k, fc(features at k-1)) predicting t_{k+1}. Depth
d >= 1 anchored at k is what drafting puts after a root at k: token `ptd_token_id`, hidden
fc(mask_hidden), position k + d, predicting t_{k+d+1} (target probs at k + d). It attends to
the depth-0 rows 0..k and its own chain's depths 1..d (`EagleHead.chain_forward`), so every
depth of a layer is computed in one pass over that depth's rows, with no self-feeding.

COD sampling: depth d keeps a share max(0.7^d, 0.2) of the anchors, as chains (the kept
anchors of depth d are the first ones of one random permutation per sequence, so they are a
subset of depth d - 1's and every kept row has its whole chain). Loss: soft cross-entropy to
the target's distribution over all kept rows of all depths, equally weighted.

Options: parallel_depth K (6: depths 0..K-1), num_layers (2), ptd_token_id (the target's
eos token), plus eagle3's (draft_vocab_size, intermediate_size, ...).
"""

from __future__ import annotations

import math

import torch

from outrider.draft_worker.training import TrainArgs, register_trainer
from outrider.draft_worker.training.common import save_checkpoint, train_loop
from outrider.draft_worker.training.data import DistillData
from outrider.draft_worker.training.eagle3 import TargetProbs, eagle3_feature_layers, fused_inputs, new_head


def cod_keep(depth: int) -> float:
    return max(0.7**depth, 0.2)


def cod_loss(head, tokens, features, final, probs: TargetProbs, depth: int, generator) -> torch.Tensor:
    """Soft-CE over depth 0 (all rows) and COD-sampled chains of depths 1..depth-1."""
    b, t = tokens.shape
    h0 = fused_inputs(head, features)  # [B, T, H]
    embeds0 = head.embed_tokens(tokens)
    target = probs(final)  # [B, T, Vd]
    perm = torch.stack([torch.randperm(t, generator=generator) for _ in range(b)])  # [B, T]
    counts = [math.ceil(cod_keep(d) * t) for d in range(depth)]
    mask_g = head.project(head.mask_hidden)  # [H]
    ptd = head.embed_tokens(torch.tensor(head.cfg.ptd_token_id))  # [H]
    # Layer by layer; within a layer depth d needs only depths < d of the same layer.
    inputs = [h0] + [mask_g.expand(b, counts[d], -1) for d in range(1, depth)]
    for layer in range(head.cfg.num_layers):
        first = layer == 0
        out0, context_kv = head.context_forward(layer, inputs[0], embeds0 if first else None)
        outputs, chain = [out0], []
        for d in range(1, depth):
            anchors = perm[:, : counts[d]]  # [B, n_d], nested prefixes of one permutation
            embeds = ptd.expand(b, counts[d], -1) if first else None
            out, kv = head.chain_forward(
                layer,
                inputs[d],
                embeds,
                anchors + d,
                anchors,
                context_kv,
                [(k[:, : counts[d]], v[:, : counts[d]]) for k, v in chain],
            )
            outputs.append(out)
            chain.append(kv)
        inputs = outputs
    per_row = -(target * head.logits(inputs[0]).float().log_softmax(-1)).sum(-1)  # [B, T]
    total, rows = per_row.sum(), per_row.numel()
    for d in range(1, depth):
        anchors = perm[:, : counts[d]]
        valid = anchors + d < t
        at = (anchors + d).clamp(max=t - 1)
        p = target.gather(1, at[..., None].expand(-1, -1, target.shape[-1]))
        per_row = -(p * head.logits(inputs[d]).float().log_softmax(-1)).sum(-1)
        total, rows = total + (per_row * valid).sum(), rows + int(valid.sum())
    return total / rows


@register_trainer("peagle", layers=eagle3_feature_layers)
def train_peagle(args: TrainArgs, data: DistillData) -> dict:
    eos = data.target_config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    options = {
        "target_dir": args.target_dir,
        "num_layers": 2,
        "ptd_token_id": eos or 0,
        **args.method_options,
    }
    torch.manual_seed(args.seed)
    head = new_head(data, options, parallel=True)
    depth = int(options.get("parallel_depth", 6))
    probs = TargetProbs(data, head)
    n = data.tokens.shape[0]

    def step_loss(step: int, generator: torch.Generator) -> torch.Tensor:
        rows = torch.randint(n, (args.batch_size,), generator=generator)
        tokens, features = data.batch(rows)
        return cod_loss(head, tokens, features, features[data.num_layers], probs, depth, generator)

    metrics = train_loop(head, args, step_loss, desc="peagle head")
    save_checkpoint(
        args.out_dir,
        head.checkpoint_tensors(include_embedding=bool(options.get("save_embedding", True))),
        head.cfg.to_hf(),
    )
    return metrics
