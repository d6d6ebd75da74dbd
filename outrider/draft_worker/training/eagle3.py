"""EAGLE-3 training with the training-time test (arXiv 2503.01840; docs/algorithms.md section 3).

    outrider train-draft --method eagle3 --target DIR --out DIR --steps 600

Rows and targets (row k of a sequence = what the drafter holds for token t_k):

    step 0   input (t_k, g_{k-1} = fc(target features at k-1))   predicts t_{k+1}: p_target(k)
    step s   input (t_{k+s}, the step s-1 output of row k)        predicts t_{k+s+1}: p_target(k+s)

Step s is the drafter's s-th self-fed step exactly as at serving time: its row sits at
position k+s and attends to the step-0 rows 0..k (real features) and to its own earlier
steps (`EagleHead.chain_forward`). Loss = sum_s 0.8^s * soft-CE(target probs restricted to
the draft vocabulary, draft log-probs); no feature regression. Target probabilities come from
the stored final hidden states through the target's head, restricted to the draft ids.

Options (`TrainArgs.method_options`): ttt_steps (7), draft_vocab_size (min(V, 32000): the
most frequent tokens of the data), intermediate_size / num_heads / num_kv_heads (default:
the target's), save_embedding (True: the head carries embed_tokens, so it loads without the
target folder; published heads omit it).
"""

from __future__ import annotations

import torch

from outrider.draft_worker.eagle_head import EagleHead, EagleHeadConfig, eagle3_layer_ids
from outrider.draft_worker.training import TrainArgs, register_trainer
from outrider.draft_worker.training.common import save_checkpoint, train_loop
from outrider.draft_worker.training.data import DistillData

STEP_DECAY = 0.8


def eagle3_feature_layers(num_layers: int) -> tuple[int, ...]:
    return (*eagle3_layer_ids(num_layers), num_layers)  # + the final hidden, for target probs


def new_head(data: DistillData, options: dict, *, parallel: bool = False) -> EagleHead:
    """A fresh head shaped after the target, with the target's embedding and a draft vocabulary."""
    target = data.target_config
    hidden, heads = data.hidden_size, int(target["num_attention_heads"])
    vocab = data.vocab_size
    draft_vocab = min(vocab, int(options.get("draft_vocab_size", 32000)))
    cfg = EagleHeadConfig(
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        hidden_size=hidden,
        intermediate_size=int(options.get("intermediate_size", target["intermediate_size"])),
        num_heads=int(options.get("num_heads", heads)),
        num_kv_heads=int(options.get("num_kv_heads", target.get("num_key_value_heads") or heads)),
        head_dim=hidden // int(options.get("num_heads", heads)),
        num_layers=int(options.get("num_layers", 1)),
        rms_norm_eps=float(target.get("rms_norm_eps", 1e-5)),
        rope_theta=float(target.get("rope_theta", 10000.0)),
        max_position_embeddings=int(target.get("max_position_embeddings", 2048)),
        feature_layer_ids=eagle3_layer_ids(data.num_layers),
        parallel_drafting=parallel,
        ptd_token_id=int(options["ptd_token_id"]) if parallel else None,
    )
    head = EagleHead(cfg)
    from outrider.target_worker.loader import CheckpointReader

    embed = CheckpointReader(options["target_dir"]).read("model.embed_tokens.weight", torch.float32)
    head.embed_tokens.weight.data.copy_(embed)
    draft_ids = data.token_counts().topk(draft_vocab).indices.sort().values
    head.set_draft_vocab(draft_ids)
    head.lm_head.weight.data.copy_(data.head_weight[draft_ids])  # a warm start: the target's rows
    return head


class TargetProbs:
    """Target next-token distributions over the draft vocabulary, from final hidden states."""

    def __init__(self, data: DistillData, head: EagleHead):
        self.weight = data.head_weight[head.draft_ids]  # [Vd, H]

    def __call__(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., Vd] probabilities (renormalised over the draft vocabulary)."""
        with torch.no_grad():
            return (final_hidden.float() @ self.weight.T).softmax(-1)


def fused_inputs(head: EagleHead, features: dict[int, torch.Tensor]) -> torch.Tensor:
    """[B, T, 3H] raw features -> g rows [B, T, H]: row k carries fc(features at k - 1), row 0 zeros."""
    raw = torch.cat([features[i] for i in head.cfg.feature_layer_ids], -1)
    raw = torch.cat([torch.zeros_like(raw[:, :1]), raw[:, :-1]], 1)
    return head.project(raw)


def soft_ce(logits: torch.Tensor, probs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean over valid rows of -sum p log q; logits/probs [B, n, Vd], valid [B, n] bool."""
    per_row = -(probs * logits.float().log_softmax(-1)).sum(-1)
    return (per_row * valid).sum() / valid.sum().clamp(min=1)


def ttt_loss(
    head: EagleHead,
    tokens: torch.Tensor,  # [B, T]
    features: dict[int, torch.Tensor],  # layer id -> [B, T, H]
    final: torch.Tensor,  # [B, T, H] the target's final hidden states
    probs: TargetProbs,
    steps: int,
    agreement: bool = True,
) -> tuple[torch.Tensor, list[float]]:
    """The unrolled loss of one batch, and the draft/target top-1 agreement at each step (an
    argmax over [B, T, Vd] per step costs ~10% of a training step: `agreement=False` skips it)."""
    b, t = tokens.shape
    g = fused_inputs(head, features)  # [B, T, H]
    embeds = head.embed_tokens(tokens)  # [B, T, H]
    out, context_kv = head.context_forward(0, g, embeds)
    target = probs(final)  # [B, T, Vd]
    anchors = torch.arange(t).expand(b, t)
    total, agreed, chain = 0.0, [], []
    for s in range(steps):
        valid = anchors + s < t  # [B, T]
        if s > 0:
            shifted = (anchors + s).clamp(max=t - 1)
            out, kv = head.chain_forward(
                0,
                out,
                embeds.gather(1, shifted[..., None].expand(-1, -1, embeds.shape[-1])),
                shifted,
                anchors,
                context_kv,
                chain,
            )
            chain.append(kv)
        logits = head.logits(out)
        step_target = target[:, s:]
        n = t - s
        loss = soft_ce(logits[:, :n], step_target, valid[:, :n])
        total = total + STEP_DECAY**s * loss
        if agreement:
            with torch.no_grad():
                agreed.append(float((logits[:, :n].argmax(-1) == step_target.argmax(-1)).float().mean()))
    return total, agreed


@register_trainer("eagle3", layers=eagle3_feature_layers)
def train_eagle3(args: TrainArgs, data: DistillData) -> dict:
    options = {"target_dir": args.target_dir, **args.method_options}
    torch.manual_seed(args.seed)
    head = new_head(data, options)
    steps = int(options.get("ttt_steps", 7))
    probs = TargetProbs(data, head)
    n = data.tokens.shape[0]
    last: dict = {}

    def step_loss(step: int, generator: torch.Generator) -> torch.Tensor:
        rows = torch.randint(n, (args.batch_size,), generator=generator)
        tokens, features = data.batch(rows)
        last_step = step == args.steps - 1  # the agreement is reported for the last step only
        loss, agreement = ttt_loss(head, tokens, features, features[data.num_layers], probs, steps, last_step)
        if last_step:
            last["agreement"] = agreement
        return loss

    metrics = train_loop(head, args, step_loss, desc="eagle3 head")
    save_checkpoint(
        args.out_dir,
        head.checkpoint_tensors(include_embedding=bool(options.get("save_embedding", True))),
        head.cfg.to_hf(),
    )
    metrics["train_agreement_per_step"] = last.get("agreement")
    return metrics
