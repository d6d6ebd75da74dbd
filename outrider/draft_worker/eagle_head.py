"""The EAGLE-3 head network (also P-EAGLE's), its checkpoint layout, and its two forwards.

One module serves training (autograd, `chain_forward`) and drafting (KV cache, `forward`),
so the two can never disagree. Per row (docs/algorithms.md section 3):

    g   = fc(cat(h_low, h_mid, h_high))          [H]   target features -> draft width (or
                                                        the draft's own previous output hidden)
    x   = cat(input_layernorm(embed(t)), hidden_norm(g))          [2H]
    h   = g + o(attn(q, k, v of x))                               first layer: 2H attention input
    h   = h + mlp(post_attention_layernorm(h))
    ... further layers (P-EAGLE may have 2): plain Llama blocks over h
    out = h                                    fed back as g for the next draft step
    logits = lm_head(norm(h))                  [draft_vocab]; target id = d + d2t[d]

Checkpoint keys (yuhuili/EAGLE3-* layout; vLLM/SGLang read the same):

    fc.weight [H, 3H]; midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight;
    midlayer.self_attn.{q,k,v}_proj.weight [., 2H]; midlayer.self_attn.o_proj.weight;
    midlayer.mlp.{gate,up,down}_proj.weight; norm.weight; lm_head.weight [Vd, H];
    d2t [Vd] int64; t2d [V] bool; optional embed_tokens.weight [V, H] (published heads omit
    it: the target's is used). Heads with more layers use layers.{i}.* (layers.0 = midlayer).
    P-EAGLE adds mask_hidden [3H] (a learned stand-in for the raw target feature, so fc
    applies to it as to real features) and ptd_token_id (int64 scalar tensor).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from outrider.target_worker.layers.attention import AttentionPlan, plan_attention, ragged_attention

if TYPE_CHECKING:
    from outrider.target_worker.batch import ForwardBatch


@dataclass(frozen=True)
class EagleHeadConfig:
    vocab_size: int  # the target's vocabulary (embedding rows, t2d length)
    draft_vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int = 1
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    target_hidden_size: int | None = None  # width of each fused target feature; default H
    num_features: int = 3  # target layers fused by fc
    feature_layer_ids: tuple[int, ...] | None = None  # the target layers tapped (ours; None = standard)
    parallel_drafting: bool = False  # P-EAGLE: mask_hidden + ptd_token_id
    ptd_token_id: int | None = None

    @property
    def feature_width(self) -> int:
        return self.num_features * (self.target_hidden_size or self.hidden_size)

    def to_hf(self, architecture: str = "LlamaForCausalLMEagle3") -> dict[str, Any]:
        """config.json in the published EAGLE-3 style (LlamaForCausalLMEagle3 fields)."""
        config = {
            "architectures": [architecture],
            "model_type": "llama",
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": self.num_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }
        if self.target_hidden_size:
            config["target_hidden_size"] = self.target_hidden_size
        if self.feature_layer_ids is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.feature_layer_ids)}
        if self.parallel_drafting:
            config["parallel_drafting"] = True
            config["ptd_token_id"] = self.ptd_token_id
        return config

    @staticmethod
    def from_hf(config: dict[str, Any]) -> EagleHeadConfig:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        eagle = config.get("eagle_config") or {}
        layer_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        return EagleHeadConfig(
            vocab_size=int(config["vocab_size"]),
            draft_vocab_size=int(config.get("draft_vocab_size") or config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            num_layers=int(config.get("num_hidden_layers", 1)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            target_hidden_size=config.get("target_hidden_size"),
            feature_layer_ids=tuple(layer_ids) if layer_ids else None,
            parallel_drafting=bool(config.get("parallel_drafting", False)),
            ptd_token_id=config.get("ptd_token_id"),
        )


def rope_table(head_dim: int, theta: float, max_positions: int) -> torch.Tensor:
    """[P, D/2] complex: HF's rotate-half RoPE, applied to halves (no row permutation)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x [..., T, heads, D] rotate-half layout; rotation [..., T, 1, D/2] complex."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    cos, sin = rotation.real, rotation.imag
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: EagleHeadConfig, in_width: int):
        super().__init__()
        d = cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = nn.Linear(in_width, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(in_width, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(in_width, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, cfg.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, rotation: torch.Tensor):
        """x [..., T, W] -> q [..., T, Hq, D], k, v [..., T, Hkv, D], RoPE applied to q and k."""
        shape = x.shape[:-1]
        q = self.q_proj(x).view(*shape, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(*shape, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(*shape, self.num_kv_heads, self.head_dim)
        return apply_rope(q, rotation), apply_rope(k, rotation), v


class Block(nn.Module):
    """One draft decoder layer; the first one reads cat(input_layernorm(embed), hidden_norm(g))."""

    def __init__(self, cfg: EagleHeadConfig, first: bool):
        super().__init__()
        h = cfg.hidden_size
        self.first = first
        if first:
            self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 2 * h if first else h)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = nn.ModuleDict(
            {
                "gate_proj": nn.Linear(h, cfg.intermediate_size, bias=False),
                "up_proj": nn.Linear(h, cfg.intermediate_size, bias=False),
                "down_proj": nn.Linear(cfg.intermediate_size, h, bias=False),
            }
        )

    def attn_input(self, h: torch.Tensor, embeds: torch.Tensor | None) -> torch.Tensor:
        if self.first:
            return torch.cat([self.input_layernorm(embeds), self.hidden_norm(h)], -1)
        return self.input_layernorm(h)

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """attn [..., T, Hq * D] -> the block's output residual stream."""
        h = h + self.self_attn.o_proj(attn)
        x = self.post_attention_layernorm(h)
        mlp = self.mlp
        return h + mlp["down_proj"](F.silu(mlp["gate_proj"](x)) * mlp["up_proj"](x))


class EagleHead(nn.Module):
    def __init__(self, cfg: EagleHeadConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's embedding, frozen
        self.fc = nn.Linear(cfg.feature_width, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([Block(cfg, first=i == 0) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        if cfg.parallel_drafting:
            self.mask_hidden = nn.Parameter(torch.zeros(cfg.feature_width))
        # A plain attribute, not a buffer: Module.to(dtype) would cast the complex table to real.
        self.rope = rope_table(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings + 64)

    # ---- vocabulary -----------------------------------------------------------------------

    def set_draft_vocab(self, draft_ids: torch.Tensor) -> None:
        """draft_ids [Vd] sorted target ids -> d2t (offsets) and t2d (membership)."""
        draft_ids = draft_ids.to(torch.int64).sort().values
        self.d2t.copy_(draft_ids - torch.arange(draft_ids.shape[0]))
        self.t2d.zero_()
        self.t2d[draft_ids] = True

    @property
    def draft_ids(self) -> torch.Tensor:
        """[Vd] target id of each draft id."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Output hidden [..., H] -> draft-vocabulary logits [..., Vd]."""
        return self.lm_head(self.norm(out))

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Raw fused target features [..., 3H] -> g [..., H]."""
        return self.fc(features)

    # ---- training: rows with an anchor, attending along their own chain -------------------

    def chain_forward(
        self,
        layer: int,
        h: torch.Tensor,  # [B, n, H] this layer's input for the n rows per sequence of one depth
        embeds: torch.Tensor | None,  # [B, n, H] token embeddings (first layer only)
        positions: torch.Tensor,  # [B, n] RoPE positions
        anchors: torch.Tensor,  # [B, n] int64: the row attends to depth-0 rows 0..anchor
        context_kv: tuple[torch.Tensor, torch.Tensor],  # depth-0 k, v: [B, T, Hkv, D]
        chain_kv: list[tuple[torch.Tensor, torch.Tensor]],  # earlier depths of the same rows: [B, n, Hkv, D]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One layer over one draft depth (training-time test, P-EAGLE depths): each row
        attends to the depth-0 rows up to its anchor, then to its own chain's earlier depths
        and itself, exactly what it sees when drafting. Returns (output [B, n, H], its (k, v))."""
        block = self.layers[layer]
        q, k, v = block.self_attn.qkv(block.attn_input(h, embeds), self.rope[positions][:, :, None])
        group = q.shape[2] // k.shape[2]
        ck, cv = context_kv
        own_k = torch.stack([*(x for x, _ in chain_kv), k], 2)  # [B, n, S, Hkv, D]
        own_v = torch.stack([*(y for _, y in chain_kv), v], 2)
        if group > 1:
            ck, cv = ck.repeat_interleave(group, 2), cv.repeat_interleave(group, 2)
            own_k, own_v = own_k.repeat_interleave(group, 3), own_v.repeat_interleave(group, 3)
        scale = 1.0 / math.sqrt(q.shape[-1])
        scores = torch.einsum("bnhd,bthd->bhnt", q, ck) * scale  # [B, Hq, n, T]
        visible = torch.arange(ck.shape[1], device=q.device) <= anchors[..., None]  # [B, n, T]
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        own_scores = torch.einsum("bnhd,bnshd->bhns", q, own_k) * scale  # [B, Hq, n, S]
        weights = torch.cat([scores, own_scores], -1).float().softmax(-1).to(v.dtype)
        t = ck.shape[1]
        attn = torch.einsum("bhnt,bthd->bnhd", weights[..., :t], cv) + torch.einsum(
            "bhns,bnshd->bnhd", weights[..., t:], own_v
        )
        return block.finish(h, attn.flatten(2)), (k, v)

    def context_forward(
        self, layer: int, h: torch.Tensor, embeds: torch.Tensor | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Depth 0 over whole sequences [B, T, H] (row i at position i), causal; returns (out, (k, v))."""
        block = self.layers[layer]
        t = h.shape[1]
        q, k, v = block.self_attn.qkv(block.attn_input(h, embeds), self.rope[:t][:, None].to(h.device))
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        ).transpose(1, 2)
        return block.finish(h, attn.flatten(2)), (k, v)

    # ---- drafting: a ragged batch against a KV cache ----------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,  # input_ids, positions, cache_rows, per-sequence kv extents and masks
        hidden: torch.Tensor,  # [T, H] g of each row (projected features, or a parent's output)
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k, v): [rows, Hkv, D]
        plan: AttentionPlan | None = None,
    ) -> torch.Tensor:
        """Writes each row's K/V at its cache row; returns the output hidden [T, H]."""
        plan = plan_attention(batch) if plan is None else plan
        embeds = self.embed_tokens(batch.input_ids)
        rotation = self.rope[batch.positions][:, None]
        h = hidden.to(self.fc.weight.dtype)
        for block, (k_cache, v_cache) in zip(self.layers, kv_layers, strict=True):
            q, k, v = block.self_attn.qkv(block.attn_input(h, embeds), rotation)
            k_cache.index_copy_(0, batch.cache_rows, k)
            v_cache.index_copy_(0, batch.cache_rows, v)
            attn = ragged_attention(q, k_cache, v_cache, plan)
            h = block.finish(h, attn.reshape(attn.shape[0], -1))
        return h

    # ---- checkpoints ------------------------------------------------------------------------

    def checkpoint_tensors(self, include_embedding: bool = True) -> dict[str, torch.Tensor]:
        """The published key layout (see the module docstring)."""
        out = {}
        for name, value in self.state_dict().items():
            if name == "embed_tokens.weight" and not include_embedding:
                continue
            if name.startswith("layers.") and self.cfg.num_layers == 1:
                name = "midlayer." + name.split(".", 2)[2]
            out[name] = value
        if self.cfg.parallel_drafting:
            out["ptd_token_id"] = torch.tensor(self.cfg.ptd_token_id, dtype=torch.int64)
        return out


class CheckpointFormatError(ValueError):
    """A head folder that is not in a layout we read (or only as pickle)."""


def read_head_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a head folder: model.safetensors (or shards). `.bin` is refused: pickle."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        if pickled:
            raise CheckpointFormatError(
                f"{folder} holds only {', '.join(pickled)}: PyTorch pickle files, which Outrider never "
                "loads (unpickling runs arbitrary code). Convert once, where you trust the file: "
                "`safetensors.torch.save_file(torch.load(path, weights_only=True), 'model.safetensors')`"
            )
        raise CheckpointFormatError(f"{folder} has no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def load_head(
    folder: str | Path, *, embed_from: str | Path | None = None, device: torch.device | str = "cpu"
) -> EagleHead:
    """An EagleHead from a published-layout folder; the embedding from the head or `embed_from`."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    cfg = EagleHeadConfig.from_hf(config)
    tensors = read_head_tensors(folder)
    renamed: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        name = name.removeprefix("model.")
        if name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer.") :]
        renamed[name] = value
    if "ptd_token_id" in renamed:
        ptd = int(renamed.pop("ptd_token_id"))
        cfg = EagleHeadConfig(**{**cfg.__dict__, "parallel_drafting": True, "ptd_token_id": ptd})
    if "mask_hidden" in renamed:
        renamed["mask_hidden"] = renamed["mask_hidden"].reshape(-1)
    if "embed_tokens.weight" not in renamed:
        if embed_from is None:
            raise CheckpointFormatError(
                f"{folder} has no embed_tokens.weight (published EAGLE-3 heads share the target's): "
                "give the option `target_model` (the target checkpoint folder) to read it from"
            )
        from outrider.target_worker.loader import CheckpointReader

        renamed["embed_tokens.weight"] = CheckpointReader(embed_from).read(
            "model.embed_tokens.weight", torch.float32
        )
    head = EagleHead(cfg)
    for name in ("d2t", "t2d"):
        if name not in renamed:  # a head over the full vocabulary
            renamed[name] = head.state_dict()[name]
    expected = set(head.state_dict())
    missing, unexpected = sorted(expected - set(renamed)), sorted(set(renamed) - expected)
    if missing or unexpected:
        raise CheckpointFormatError(
            f"{folder}: not an EAGLE-3 head layout (missing {missing}, unexpected {unexpected})"
        )
    dtype = next(v for k, v in renamed.items() if k == "fc.weight").dtype
    state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in renamed.items()}
    state["d2t"], state["t2d"] = state["d2t"].to(torch.int64), state["t2d"].to(torch.bool)
    head.load_state_dict(state)
    head = head.to(device=device, dtype=dtype).eval()
    head.rope = head.rope.to(device)
    return head


def eagle3_layer_ids(num_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs EAGLE-3 fuses: {2, L//2, L-3} (docs/algorithms.md section 3).

    Those are distinct and increasing only from L = 7. Smaller targets (the demo family has
    2-4 layers) keep low / mid / high as far as such a stack has them, always three distinct
    ids (the handshake refuses a repeated layer): L = 4..6 -> the inputs of layers 1, L//2,
    L-1 (L = 4: 1, 2, 3); L = 2..3 -> the last two layer inputs and the final hidden state
    (id L, after the final norm): L = 2 -> 0, 1, 2.
    """
    if num_layers < 2:
        raise ValueError(f"EAGLE-3 needs a target of at least 2 layers, not {num_layers}")
    low, mid, high = 2, num_layers // 2, num_layers - 3
    if low < mid < high:
        return (low, mid, high)
    if num_layers >= 4:
        return (1, num_layers // 2, num_layers - 1)
    return (num_layers - 2, num_layers - 1, num_layers)
