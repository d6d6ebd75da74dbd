"""A minimal greedy speculative loop over `ModelRunner` and any DraftSource, for the client tests.

Stands in for the engine (target_worker/engine.py) until it lands: per round it submits each
sequence's delta, collects trees with a deadline, verifies every tree greedily in one ragged
forward, commits the accepted path's KV and emits accepted + bonus tokens. A sequence with no
tree, or a tree whose root is not its last token, decodes one token. With `source=None` it is
plain greedy decoding, the reference every speculative run must equal token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from proto import SamplingParams, SequenceUpdate, TreeBudget
from target_worker.batch import SequenceChunk, build_forward_batch
from target_worker.draft_source import DraftSource
from target_worker.runner import ModelRunner


@dataclass
class LoopStats:
    rounds: int = 0
    submitted: int = 0  # updates sent for a tree (sequence-rounds)
    trees_used: int = 0
    accepted: int = 0  # draft tokens accepted, all sequences


def greedy_generate(
    runner: ModelRunner,
    prompts: list[list[int]],
    max_new_tokens: int,
    source: DraftSource | None = None,
    budget: TreeBudget | None = None,
    timeout_s: float = 1.0,
    seq_id_base: int = 0,
    stats: LoopStats | None = None,
) -> list[list[int]]:
    stats = stats or LoopStats()
    budget = budget or TreeBudget(max_nodes=8, max_depth=4, top_k=2)
    ids = [seq_id_base + i for i in range(len(prompts))]
    starts = [
        runner.cache.allocate(s, len(p) + max_new_tokens + budget.max_nodes + 2)
        for s, p in zip(ids, prompts, strict=True)
    ]
    try:
        prefill = [SequenceChunk(start, 0, torch.tensor(p)) for start, p in zip(starts, prompts, strict=True)]
        logits = runner.forward(build_forward_batch(prefill, device=runner.device)).logits
        outputs = [[int(row.argmax())] for row in logits]
        context = [len(p) for p in prompts]  # tokens whose KV is cached; the last output is not
        deltas = [list(p) + out for p, out in zip(prompts, outputs, strict=True)]
        live = [b for b in range(len(prompts)) if len(outputs[b]) < max_new_tokens]
        while live:
            stats.rounds += 1
            trees = {}
            if source is not None:
                source.submit(
                    [
                        SequenceUpdate(
                            ids[b], stats.rounds, torch.tensor(deltas[b]), SamplingParams(), budget
                        )
                        for b in live
                    ]
                )
                stats.submitted += len(live)
                trees = source.collect([ids[b] for b in live], timeout_s)
            chunks, parents_of = [], []
            for b in live:
                tree = trees.get(ids[b])
                if tree is not None and int(tree.tokens[0]) == outputs[b][-1]:
                    stats.trees_used += 1
                    chunks.append(SequenceChunk(starts[b], context[b], tree.tokens, parents=tree.parents))
                    parents_of.append(tree.parents.tolist())
                else:
                    chunks.append(
                        SequenceChunk(starts[b], context[b], torch.tensor([outputs[b][-1]]), all_logits=True)
                    )
                    parents_of.append([-1])
            logits = runner.forward(build_forward_batch(chunks, device=runner.device)).logits
            best = logits.argmax(dim=-1).tolist()
            accepted_ids, offset = [], 0
            for b, chunk, parents in zip(live, chunks, parents_of, strict=True):
                tokens = chunk.token_ids.tolist()
                path, node = [], 0
                while True:  # follow the child holding the target's argmax, as far as one exists
                    child = next(
                        (
                            c
                            for c in range(node + 1, len(tokens))
                            if parents[c] == node and tokens[c] == best[offset + node]
                        ),
                        None,
                    )
                    if child is None:
                        break
                    path.append(child)
                    node = child
                emitted = [tokens[c] for c in path] + [best[offset + node]]
                stats.accepted += len(path)
                offset += len(tokens)
                accepted_ids.append(path)
                context[b] += 1 + len(path)
                outputs[b].extend(emitted)
                deltas[b] = emitted
            width = max(1, max(len(p) for p in accepted_ids))
            padded = torch.tensor([p + [-1] * (width - len(p)) for p in accepted_ids], dtype=torch.int64)
            roots = torch.tensor([c.cache_start + c.context_len for c in chunks], dtype=torch.int64)
            runner.cache.commit_paths(padded, roots)
            finished = [b for b in live if len(outputs[b]) >= max_new_tokens]
            if source is not None and finished:
                source.submit(
                    [
                        SequenceUpdate(
                            ids[b],
                            stats.rounds + 1,
                            torch.tensor(deltas[b]),
                            SamplingParams(),
                            budget,
                            finished=True,
                        )
                        for b in finished
                    ]
                )
            live = [b for b in live if b not in finished]
        return [out[:max_new_tokens] for out in outputs]
    finally:
        for s in ids:
            runner.cache.free(s)
