"""The model runner: a loaded model, its KV cache, and one forward over a ragged batch.

    runner = ModelRunner.from_pretrained(path, max_model_len=2048, kv_cache_rows=65536)
    start = runner.cache.allocate(seq_id, prompt_len + max_new_tokens + tree_budget)   # or paged:
    #   SequenceChunk(-1, context, ids, blocks=table, block_size=16)  (`BlockManager`)
    batch = build_forward_batch([SequenceChunk(start, 0, prompt_ids), ...])
    out = runner.forward(batch)            # out.logits: [R, V] for batch.logits_rows
    runner.cache.compact(...)              # after verifying a tree

The runner knows nothing of speculation: trees reach it only as attention masks and
positions inside `ForwardBatch`. Under tensor parallelism every rank builds its own runner
with its `TPGroup` and is given the same batch; all ranks return the full logits.
"""

from __future__ import annotations

from pathlib import Path

import torch

from outrider.target_worker.batch import ForwardBatch, ForwardOutput
from outrider.target_worker.kv_cache import KVCache
from outrider.target_worker.layers.attention import plan_attention
from outrider.target_worker.loader import CheckpointReader
from outrider.target_worker.models import CausalLM, resolve_architecture
from outrider.target_worker.parallel.group import TPGroup


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCache, max_model_len: int):
        self.model, self.cache, self.max_model_len = model, cache, max_model_len

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        max_model_len: int,
        kv_cache_rows: int | None = None,
        kv_cache_bytes: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        tp: TPGroup | None = None,
    ) -> ModelRunner:
        """Loads an HF folder. Size the cache by rows or by bytes (per rank); default: 8 full-length sequences."""
        reader = CheckpointReader(path)
        arch = resolve_architecture(reader.config)
        model = arch.from_checkpoint(
            reader, tp or TPGroup(), dtype or reader.checkpoint_dtype, device, max_model_len
        )
        spec = model.kv_spec()
        if kv_cache_rows is None:
            kv_cache_rows = (
                KVCache.rows_for_budget(spec, kv_cache_bytes) if kv_cache_bytes else 8 * max_model_len
            )
        return cls(model, KVCache(spec, kv_cache_rows, device), max_model_len)

    @property
    def device(self) -> torch.device:
        """Where batches for this runner must live (`build_forward_batch(..., device=)`)."""
        return next(iter(self.cache.buffers.values())).device

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        if max(batch.kv_lens) > self.max_model_len:
            raise ValueError(
                f"a sequence reaches {max(batch.kv_lens)} tokens; max_model_len is {self.max_model_len}"
            )
        self.cache.check_rows(batch)
        return self.model.forward(batch, plan_attention(batch), self.cache.layers)
