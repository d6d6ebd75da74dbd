"""Training a DeepSeek-style MTP module (arXiv 2412.19437 section 2.2) for `draft_worker.mtp`.

    outrider train-draft --method mtp --target DIR --out DIR --steps 600

The module is the one `draft_worker.mtp` serves: row p of a sequence is (t_p, h_{p-1}), with
h the target's final hidden state after its final norm, and predicts t_{p+1}:

    x = eh_proj(cat(enorm(embed(t_p)), hnorm(h_{p-1})))  ->  block  ->  shared_head(norm(x))

so row p's label is the token two ahead of the state it was given: DeepSeek-V3's depth-1 MTP
loss. The block is `transformers`' decoder layer of the target's architecture (a Llama layer
for the demo target, MLA + MoE for DeepSeek-V3), so its tensors carry the checkpoint names.

Two uses:

- `train_mtp` (the registered trainer): a head for a frozen target (the demo Llama). The
  embedding and head are the target's, frozen and saved with the head; on the
  self-distillation data the loss is soft cross-entropy to the target's own distribution of
  t_{p+1} (acceptance rewards agreement with the target, docs/algorithms.md section 9), or plain
  CE on the data's tokens with `method_options={"loss": "ce"}`.
- `MTPHead` + `mtp_loss` for joint training, where the target trains too and h carries
  gradients (outrider/benchmarks/bench_mtp_deepseek.py: DeepSeek-V3's main loss + lambda * MTP loss).

Checkpoint (`mtp_checkpoint`): the target's config.json (num_hidden_layers = L, so the
module is `model.layers.{L}.*`) and model.safetensors holding enorm, hnorm, eh_proj, the
block (per-expert names for MoE), shared_head.norm, shared_head.head and embed_tokens.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from outrider.draft_worker.training import TrainArgs, register_trainer
from outrider.draft_worker.training.common import save_checkpoint, train_loop
from outrider.draft_worker.training.data import DistillData


def decoder_layer(target_config: dict, layer: int) -> tuple[nn.Module, nn.Module]:
    """(transformers decoder layer, its rotary embedding) for the target's architecture."""
    import transformers

    config = transformers.AutoConfig.for_model(**target_config)
    config._attn_implementation = "sdpa"
    module = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    modeling = __import__(module.__module__, fromlist=["_"])
    prefix = module.__name__.removesuffix("ForCausalLM")
    block = getattr(modeling, prefix + "DecoderLayer")(config, layer)
    rotary = getattr(modeling, prefix + "RotaryEmbedding")(config)
    return block, rotary


class MTPHead(nn.Module):
    def __init__(
        self, target_config: dict, embed: torch.Tensor, head: torch.Tensor, trainable_io: bool = False
    ):
        """`embed` [V, H] and `head` [V, H]: frozen copies unless `trainable_io` (then shared
        parameters: pass the main model's own to tie them, as DeepSeek-V3 does)."""
        super().__init__()
        self.layer = int(target_config["num_hidden_layers"])
        self.target_config = target_config
        hidden = int(target_config["hidden_size"])
        self.eps = float(target_config.get("rms_norm_eps", 1e-6))
        self.enorm = nn.Parameter(torch.ones(hidden))
        self.hnorm = nn.Parameter(torch.ones(hidden))
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block, self.rotary = decoder_layer(target_config, self.layer)
        self.head_norm = nn.Parameter(torch.ones(hidden))
        if trainable_io:
            self.embed, self.head = embed, head
        else:
            self.register_buffer("embed", embed.detach().float().clone())
            self.register_buffer("head", head.detach().float().clone())

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), weight, self.eps)

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] (t_p), hidden [B, T, H] (h_{p-1}; row 0 zeros) -> logits [B, T, V]."""
        b, t = tokens.shape
        x = torch.cat(
            [self._norm(F.embedding(tokens, self.embed), self.enorm), self._norm(hidden, self.hnorm)], -1
        )
        x = self.eh_proj(x)
        positions = torch.arange(t, device=tokens.device)[None].expand(b, t)
        mask = torch.full((t, t), float("-inf"), device=tokens.device).triu(1)[None, None]
        x = self.block(
            x, attention_mask=mask, position_ids=positions, position_embeddings=self.rotary(x, positions)
        )
        x = x[0] if isinstance(x, tuple) else x
        return self._norm(x, self.head_norm) @ self.head.T

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The published MTP names under model.layers.{L}.*."""
        tensors = {
            "enorm.weight": self.enorm,
            "hnorm.weight": self.hnorm,
            "eh_proj.weight": self.eh_proj.weight,
            "shared_head.norm.weight": self.head_norm,
            "shared_head.head.weight": self.head,
            "embed_tokens.weight": self.embed,
        }
        tensors.update(published_block_names(self.block))
        return {
            f"model.layers.{self.layer}.{k}": v.detach().float().cpu().contiguous()
            for k, v in tensors.items()
        }


def published_block_names(block: nn.Module) -> dict[str, torch.Tensor]:
    """A decoder layer's state dict with fused 3-D experts split into the per-expert layout."""
    out = {}
    for name, t in block.state_dict().items():
        if name.endswith("experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            base = name.removesuffix("gate_up_proj")
            for e, fused in enumerate(t):
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = fused.chunk(2, dim=0)
        elif name.endswith("experts.down_proj"):  # [E, H, I]
            base = name.removesuffix("down_proj")
            for e, down in enumerate(t):
                out[f"{base}{e}.down_proj.weight"] = down
        else:
            out[name] = t
    return out


def mtp_inputs(tokens: torch.Tensor, final_hidden: torch.Tensor) -> torch.Tensor:
    """[B, T, H] target states at each position -> the MTP rows' h_{p-1} (row 0: zeros)."""
    return torch.cat([torch.zeros_like(final_hidden[:, :1]), final_hidden[:, :-1]], dim=1)


def mtp_loss(
    head: MTPHead,
    tokens: torch.Tensor,  # [B, T]
    final_hidden: torch.Tensor,  # [B, T, H] the target's final hidden after its norm
    target_probs: torch.Tensor | None = None,  # [B, T, V] p_target(t_{p+1} | ..t_p), or None: hard CE
    start: int = 1,  # first row with a real h_{p-1}
    agreement: bool = True,  # False: skip the argmaxes (~15% of a demo training step), return None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(loss, greedy agreement with the label) over rows start .. T-2, which predict t_{p+1}."""
    logits = head(tokens, mtp_inputs(tokens, final_hidden))[:, start:-1].float()  # [B, T-1-start, V]
    if target_probs is None:
        labels = tokens[:, start + 1 :]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    else:
        probs = target_probs[:, start:-1]
        loss = -(probs * logits.log_softmax(-1)).sum(-1).mean()
        labels = probs.argmax(-1) if agreement else None
    if not agreement:
        return loss, None
    with torch.no_grad():
        return loss, (logits.argmax(-1) == labels).float().mean()


def mtp_checkpoint(out_dir: str | Path, head: MTPHead, tokenizer_dir: str | Path | None = None) -> Path:
    """A standalone MTP folder the `mtp` proposer loads (config + tensors, tokenizer if given)."""
    config = {**head.target_config, "num_nextn_predict_layers": 1}
    out = save_checkpoint(out_dir, head.checkpoint_tensors(), config)
    tokenizer = Path(tokenizer_dir) / "tokenizer.json" if tokenizer_dir else None
    if tokenizer is not None and tokenizer.is_file():
        shutil.copy(tokenizer, out / "tokenizer.json")
    return out


@register_trainer("mtp")
def train_mtp(args: TrainArgs, data: DistillData) -> dict:
    options = dict(args.method_options)
    torch.manual_seed(args.seed)
    from outrider.target_worker.loader import CheckpointReader

    reader = CheckpointReader(args.target_dir)
    embed = reader.read("model.embed_tokens.weight", torch.float32)
    head = MTPHead(data.target_config, embed, data.head_weight)
    distill = options.get("loss", "distill") == "distill"
    n, final = data.tokens.shape[0], data.num_layers
    last: dict = {}

    def step_loss(step: int, generator: torch.Generator) -> torch.Tensor:
        rows = torch.randint(n, (args.batch_size,), generator=generator)
        tokens, features = data.batch(rows)
        hidden = features[final]
        probs = data.target_logits(hidden).softmax(-1) if distill else None
        last_step = step == args.steps - 1  # the agreement is reported for the last step only
        loss, agreement = mtp_loss(head, tokens, hidden, probs, agreement=last_step)
        if last_step:
            last["agreement"] = float(agreement)
        return loss

    metrics = train_loop(head, args, step_loss, desc="mtp head")
    mtp_checkpoint(args.out_dir, head, args.target_dir)
    metrics["train_agreement"] = last.get("agreement")
    return metrics
