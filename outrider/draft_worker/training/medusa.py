"""Training Medusa-1 heads (arXiv 2401.10774) on a frozen target, for `draft_worker.medusa`.

    outrider train-draft --method medusa --target DIR --out DIR --steps 300
    method_options: num_heads (4), num_layers (1), positions (per step; 64 x batch_size),
                    loss ("distill" | "ce"),
                    train_lm_head (False: every head keeps the target's lm_head, frozen and shared;
                    True: Medusa-1's private copies, trained too)

Row t of the data is the target's final hidden state h_t (after its final norm), which the
target's own head turns into p(t_{t+1}). Head k (0-based) reads the same h_t and learns the
token k + 1 places further, t_{t+k+2}, against the target's own distribution of it given the
true prefix (self-distillation: soft cross-entropy to softmax(lm_head(h_{t+k+1}))), or against
the data's token with loss "ce". Heads are weighted 0.8^k, as in Medusa:

    loss = sum_k 0.8^k * CE(head_k(h_t), p_target(. | t_{<=t+k+1}))      t over the sampled rows

Rows are hidden states whose labels are the target's own continuation (t >= prompt - 1).
Each head starts as Medusa's: ResBlock W = 0, b = 0 and the target's lm_head, so an untrained
head repeats the target's next-token guess one place too early.

Why the lm_head stays frozen and shared by default: at batch 1 a head's V x H matmul is a GEMV
bound by reading its weights, and on the small demo target (V = 8192, H = 256) four private
fp32 heads (33 MB) cost more per round (~9 ms) than the target's own step; one shared head is
read once (bf16: ~0.7 ms). Measured on the small family (192 sequences, 300 steps): held-out
top-1 per head 0.45 / 0.32 / 0.29 / 0.27 with private heads vs 0.42 / 0.29 / 0.26 / 0.26
shared, and the private heads overfit more (train 0.60 vs 0.55 on head 0).

The last tenth of the sequences is held out; on it the trainer measures each head's top-10
accuracy against the target's greedy token, writes it to config.json as `medusa_accuracy`
[K][10] (the proposer builds its default tree from it) and returns it in the metrics.

Checkpoint: FasterDecoding's layout (`medusa_lm_head.safetensors` with `{k}.0.linear.weight`,
`{k}.0.linear.bias`, `{k}.1.weight`) and a config.json with medusa_num_heads,
medusa_num_layers, hidden_size, vocab_size, base_model_name_or_path (the target folder) and the
target's num_hidden_layers, as in FasterDecoding's full configs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from outrider.draft_worker.medusa.heads import HEADS_FILE, MedusaHeads
from outrider.draft_worker.training import TrainArgs, register_trainer
from outrider.draft_worker.training.common import train_loop
from outrider.draft_worker.training.data import DistillData

HEAD_DECAY = 0.8  # weight of head k: 0.8^k
ACCURACY_RANKS = 10
HELD_OUT = 0.1  # share of sequences kept out of training for the accuracy table


def initial_heads(
    data: DistillData, num_heads: int, num_layers: int, train_lm_head: bool = True
) -> MedusaHeads:
    """Medusa's initialisation: identity ResBlocks and copies of the target's lm_head (one
    frozen copy shared by every head when `train_lm_head` is False)."""
    heads = MedusaHeads(
        num_heads, num_layers, data.hidden_size, data.vocab_size, shared_head=not train_lm_head
    )
    heads.lm_head.data[:] = data.head_weight[None]
    heads.lm_head.requires_grad_(train_lm_head)
    return heads


def head_labels(
    data: DistillData, rows: torch.Tensor, cols: torch.Tensor, k: int, distill: bool
) -> torch.Tensor:
    """Labels of head k for rows (sequence, position t): the target's distribution of t_{t+k+2}
    given the true prefix, [R, V] (distill), or the data's token t_{t+k+2}, [R] (ce)."""
    if distill:
        hidden = data.features[data.num_layers][rows, cols + k + 1].float()
        return data.target_logits(hidden).softmax(-1)
    return data.tokens[rows, cols + k + 2]


def medusa_loss(
    heads: MedusaHeads,
    data: DistillData,
    rows: torch.Tensor,
    cols: torch.Tensor,
    distill: bool = True,
    agreement: bool = True,
) -> tuple[torch.Tensor, list[float]]:
    """(the 0.8^k-weighted loss, each head's top-1 agreement with its label) at positions (rows, cols).

    Heads are taken apart with `unbind`, not indexed: autograd would zero-fill the whole
    [R, K, V] gradient once per indexed head (a fifth of a step). The agreement's argmaxes are
    another tenth: `agreement=False` skips them and returns []."""
    logits = heads(data.features[data.num_layers][rows, cols].float()).float()  # [R, K, V]
    total, agreed = logits.new_zeros(()), []
    for k, head_logits in enumerate(logits.unbind(1)):
        labels = head_labels(data, rows, cols, k, distill)
        log_q = head_logits.log_softmax(-1)
        if distill:
            loss = -(labels * log_q).sum(-1).mean()
        else:
            loss = F.nll_loss(log_q, labels)
        total = total + HEAD_DECAY**k * loss
        if agreement:
            with torch.no_grad():
                greedy = labels.argmax(-1) if distill else labels
                agreed.append(float((log_q.argmax(-1) == greedy).float().mean()))
    return total, agreed


def valid_positions(
    data: DistillData, sequences: torch.Tensor, num_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (sequence, t) whose labels for all heads lie in the target's continuation."""
    length = data.tokens.shape[1]
    cols = torch.arange(max(data.prompt_tokens - 1, 0), length - num_heads - 1)
    if cols.numel() == 0:
        raise ValueError(
            f"medusa: sequences of {length} tokens leave no room for {num_heads} heads after the prompt"
        )
    return sequences.repeat_interleave(cols.numel()), cols.repeat(sequences.numel())


@torch.inference_mode()
def head_accuracy(
    heads: MedusaHeads, data: DistillData, sequences: torch.Tensor, ranks: int = ACCURACY_RANKS
) -> list[list[float]]:
    """[K][ranks]: how often head k's rank-r token is the target's greedy token t_{t+k+2}."""
    rows, cols = valid_positions(data, sequences, heads.num_heads)
    hits = torch.zeros(heads.num_heads, ranks)
    for start in range(0, rows.numel(), 1024):
        r, c = rows[start : start + 1024], cols[start : start + 1024]
        top = heads(data.features[data.num_layers][r, c].float()).topk(ranks, dim=-1).indices  # [R, K, ranks]
        for k in range(heads.num_heads):
            greedy = head_labels(data, r, c, k, distill=True).argmax(-1)  # [R]
            hits[k] += (top[:, k] == greedy[:, None]).float().sum(0)
    return (hits / max(rows.numel(), 1)).tolist()


def save_medusa(out_dir: str | Path, heads: MedusaHeads, config: dict) -> Path:
    """The heads in FasterDecoding's layout and their config.json, each written whole, then renamed."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    partial = out / f"{HEADS_FILE}.partial"
    save_file(heads.public_state_dict(), str(partial), metadata={"format": "pt"})
    os.replace(partial, out / HEADS_FILE)
    (out / "config.json.partial").write_text(json.dumps(config, indent=2) + "\n")
    os.replace(out / "config.json.partial", out / "config.json")
    return out


@register_trainer("medusa")
def train_medusa(args: TrainArgs, data: DistillData) -> dict:
    # positions: hidden states per step, sampled over the whole data; default 64 per sequence of
    # `batch_size` (rows of one sequence are strongly correlated, so they are not taken together).
    defaults = {
        "num_heads": 4,
        "num_layers": 1,
        "positions": 64 * args.batch_size,
        "loss": "distill",
        "train_lm_head": False,
    }
    options = defaults | dict(args.method_options)
    if set(options) - set(defaults) or options["loss"] not in ("distill", "ce"):
        raise ValueError(
            f"medusa: method_options {dict(args.method_options)}; keys are {', '.join(defaults)} "
            "(loss: 'distill' or 'ce')"
        )
    torch.manual_seed(args.seed)
    num_heads = int(options["num_heads"])
    heads = initial_heads(data, num_heads, int(options["num_layers"]), bool(options["train_lm_head"]))
    n = data.tokens.shape[0]
    held_out = max(1, round(n * HELD_OUT)) if n > 1 else 0
    rows, cols = valid_positions(data, torch.arange(n - held_out), num_heads)
    distill = options["loss"] == "distill"
    last: dict = {}

    def step_loss(step: int, generator: torch.Generator) -> torch.Tensor:
        pick = torch.randint(rows.numel(), (int(options["positions"]),), generator=generator)
        last_step = step == args.steps - 1  # the agreement is reported for the last step only
        loss, agreement = medusa_loss(heads, data, rows[pick], cols[pick], distill, agreement=last_step)
        if last_step:
            last["agreement"] = agreement
        return loss

    metrics = train_loop(heads, args, step_loss, desc="medusa heads")
    accuracy = head_accuracy(heads, data, torch.arange(n - held_out, n) if held_out else torch.arange(n))
    config = {
        "model_type": "medusa",
        "medusa_num_heads": num_heads,
        "medusa_num_layers": heads.num_layers,
        "hidden_size": data.hidden_size,
        "vocab_size": data.vocab_size,
        "base_model_name_or_path": str(Path(args.target_dir).resolve()),
        "num_hidden_layers": data.num_layers,  # the target's, as in FasterDecoding's full configs
        "torch_dtype": "float32",
        "medusa_accuracy": [[round(a, 5) for a in row] for row in accuracy],
    }
    save_medusa(args.out_dir, heads, config)
    metrics["train_agreement"] = last.get("agreement")
    metrics["held_out_top1"] = [row[0] for row in accuracy]
    return metrics
