"""Outrider kernels: tree buffers, logits processing, verification, KV compaction, paged
attention, metrics.

Each op has a torch reference (any device) and a Triton kernel (CUDA), same signature,
chosen by `kernels.backend.use_triton`. Importing this package never imports triton.
"""

from outrider.kernels.backend import Backend, use_triton
from outrider.kernels.kv_compaction import compact_kv
from outrider.kernels.logits_processing import process_logits
from outrider.kernels.packing import PackedTrees, pack_trees
from outrider.kernels.paged_attention import paged_attention
from outrider.kernels.spec_metrics import SpecDecodeCounters
from outrider.kernels.tree_buffers import TreeBuffers, build_tree_buffers, tree_attention_mask
from outrider.kernels.verification import VerifyOutput, VerifyRandoms, draw_verify_randoms, verify

__all__ = [
    "Backend",
    "PackedTrees",
    "SpecDecodeCounters",
    "TreeBuffers",
    "VerifyOutput",
    "VerifyRandoms",
    "build_tree_buffers",
    "compact_kv",
    "draw_verify_randoms",
    "pack_trees",
    "paged_attention",
    "process_logits",
    "tree_attention_mask",
    "use_triton",
    "verify",
]
