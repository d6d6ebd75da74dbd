"""Medusa's K residual heads over one hidden state, all heads in batched matmuls.

A head is ResBlock^L then a linear map to the vocabulary, ResBlock(x) = x + SiLU(W x + b), W
zero-initialised (Medusa's own layout). Head k (0-based) predicts the token k + 1 places after
the root that the target's own LM head predicted from the same hidden state.

    block_weight  [K, L, H_out, H_in]   block_bias [K, L, H]
    lm_head       [K, V, H], or [1, V, H] when every head shares one
    token_map     [V_out] int64 or None  (vLLM's truncated vocabulary)
"""

from __future__ import annotations

import torch
from torch import nn

HEADS_FILE = "medusa_lm_head.safetensors"  # FasterDecoding's file name (see `checkpoint`)


class MedusaHeads(nn.Module):
    """K heads over one hidden state: [N, H] -> [N, K, V] logits (all heads in batched matmuls).

    `shared_head`: one lm_head [1, V, H] for every head (vLLM's `original_lm_head`; what
    training with a frozen target head gives). At batch 1 a head's lm matmul is a GEMV bound by
    reading V x H weights, so K private heads cost K reads and a shared one a single read.
    """

    def __init__(
        self, num_heads: int, num_layers: int, hidden_size: int, vocab_size: int, shared_head: bool = False
    ):
        super().__init__()
        k, h = num_heads, hidden_size
        self.block_weight = nn.Parameter(torch.zeros(k, num_layers, h, h))  # [K, L, H_out, H_in]
        self.block_bias = nn.Parameter(torch.zeros(k, num_layers, h))  # [K, L, H]
        heads = 1 if shared_head else k
        self.lm_head = nn.Parameter(torch.empty(heads, vocab_size, h).normal_(std=h**-0.5))  # [K or 1, V, H]
        # vLLM's truncated vocabulary: row i of a head's output is token token_map[i].
        self.register_buffer("token_map", None)

    @property
    def num_heads(self) -> int:
        return self.block_weight.shape[0]

    @property
    def num_layers(self) -> int:
        return self.block_weight.shape[1]

    @property
    def hidden_size(self) -> int:
        return self.block_weight.shape[2]

    @property
    def shared_head(self) -> bool:
        return self.lm_head.shape[0] == 1 < self.num_heads

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, K, V_out]
        x = hidden.to(self.lm_head.dtype)[None].expand(self.num_heads, -1, -1)  # [K, N, H]
        for j in range(self.num_layers):
            w, b = self.block_weight[:, j], self.block_bias[:, j]
            x = x + nn.functional.silu(torch.baddbmm(b[:, None, :], x, w.transpose(1, 2)))
        if self.lm_head.shape[0] == 1:  # one pass over the shared weights for every head
            return nn.functional.linear(x, self.lm_head[0]).transpose(0, 1)  # [N, K, V_out]
        return torch.bmm(x, self.lm_head.transpose(1, 2)).transpose(0, 1)  # [N, K, V_out]

    def share_identical_heads(self) -> bool:
        """Collapse K equal lm_heads (a checkpoint of a frozen-head training) into one; True if done."""
        if self.lm_head.shape[0] > 1 and all(torch.equal(self.lm_head[0], w) for w in self.lm_head[1:]):
            self.lm_head = nn.Parameter(self.lm_head[:1].clone(), requires_grad=self.lm_head.requires_grad)
            return True
        return False

    def public_state_dict(self) -> dict[str, torch.Tensor]:
        """FasterDecoding's key layout (`medusa_lm_head.safetensors`), contiguous CPU tensors;
        a shared head is written once per head, as that layout has it."""
        out = {}
        for k in range(self.num_heads):
            for j in range(self.num_layers):
                out[f"{k}.{j}.linear.weight"] = self.block_weight[k, j].detach().cpu().contiguous()
                out[f"{k}.{j}.linear.bias"] = self.block_bias[k, j].detach().cpu().contiguous()
            lm = self.lm_head[0 if self.lm_head.shape[0] == 1 else k]
            out[f"{k}.{self.num_layers}.weight"] = lm.detach().cpu().clone()
        return out
