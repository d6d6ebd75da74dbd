"""Who runs, and with which KV blocks: admission, each round's slot reservation, preemption.

    admit:    first come, first served while a batch slot is free and the prompt's blocks fit
              (prefix-cached blocks reused, `BlockManager.allocate`) with a block to spare
              for each running sequence's next one (and a small watermark); none in the
              step after a preemption, so a victim does not push straight back in
    reserve:  before the forward, every verified sequence grows its table to cover its root
              and its tree; short of blocks, its tree becomes root-only, and short even of
              that, the youngest running sequence is preempted
    settle:   after the forward, committed full blocks become prefix-cache entries and tree
              scratch blocks past the next root are handed back

Preemption is by recompute (vLLM's default): the victim's blocks go back, it keeps its tokens
(prompt and output so far) and returns to the front of the queue; readmitted, it prefills them
all again (less what the prefix cache still holds) and continues exactly where it stopped, so
its output is unchanged. Its drafter is re-sent the whole sequence (`Sequence.num_sent` = 0, a
reset update), so drafter state and features line up with the recomputation.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from outrider.proto import CandidateTree
from outrider.target_worker.block_manager import BlockManager
from outrider.target_worker.round_plan import root_only_tree
from outrider.target_worker.sequence import Sequence


class KVScheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_slots: int,
        max_batch: int,
        on_admit: Callable[[Sequence], None],
    ):
        self.blocks, self.max_slots, self.max_batch, self.on_admit = blocks, max_slots, max_batch, on_admit
        self.watermark = max(1, blocks.num_blocks // 100)  # free blocks kept for growth at admission
        self.num_preemptions = 0
        self._just_preempted = False

    def admit(self, waiting: deque[Sequence], running: list[Sequence]) -> None:
        if self._just_preempted and running:
            self._just_preempted = False
            return  # blocks ran short last step: let the running sequences grow first
        while waiting and len(running) < self.max_batch:
            seq = waiting[0]
            need = self.blocks.blocks_for(len(seq.tokens))
            # Without headroom for every running sequence's next block, admitting one more
            # would only preempt someone a few rounds later (and recompute it).
            if self.blocks.num_free_blocks - need < self.watermark + len(running) and running:
                return  # wait for running sequences to finish and free blocks
            # Prompt logprobs need every prompt token's logits: no prefix-cache lookup for them.
            lookup = seq.params.prompt_logprobs is None or seq.decoding
            cached = self.blocks.allocate(seq.seq_id, seq.tokens, len(seq.tokens), lookup=lookup)
            if cached is None:
                return
            seq.blocks, seq.num_cached, seq.max_slots = self.blocks.tables[seq.seq_id], cached, self.max_slots
            self.on_admit(seq)
            running.append(waiting.popleft())

    def reserve(
        self,
        ready: list[Sequence],
        trees: list[CandidateTree],
        running: list[Sequence],
        waiting: deque[Sequence],
        round: int,
    ) -> tuple[list[Sequence], list[CandidateTree]]:
        """Slots for each verified sequence's tree (oldest first); returns those still in the
        round with their trees (a tree cut to root-only where blocks were short)."""
        kept: dict[int, tuple[Sequence, CandidateTree]] = {}
        for seq, tree in zip(ready, trees, strict=True):
            if seq.blocks is None:  # preempted earlier in this loop
                continue
            while not self.blocks.grow(seq.seq_id, seq.num_cached + tree.num_nodes):
                if tree.num_nodes > 1:
                    tree = root_only_tree(seq, round)
                    continue
                victim = running[-1]
                self.preempt(victim, running, waiting)
                kept.pop(victim.seq_id, None)
                if victim is seq:
                    break
            else:
                kept[seq.seq_id] = (seq, tree)
        return [s for s, _ in kept.values()], [t for _, t in kept.values()]

    def preempt(self, seq: Sequence, running: list[Sequence], waiting: deque[Sequence]) -> None:
        self.blocks.free(seq.seq_id)
        running.remove(seq)
        seq.blocks, seq.num_cached = None, 0
        seq.asked, seq.tree_round = False, -1
        seq.num_sent, seq.unsent_features = 0, []  # the drafter gets the whole sequence again
        if not seq.decoding:  # prompt logprobs gathered so far are gathered again
            seq.prompt_logprobs = None
        waiting.appendleft(seq)
        self.num_preemptions += 1
        self._just_preempted = True

    def settle(self, verified: list[Sequence], filled: list[Sequence]) -> None:
        for seq in verified:
            if seq.blocks is not None:
                self.blocks.commit(seq.seq_id, seq.tokens, seq.num_cached)
                self.blocks.shrink(seq.seq_id, seq.num_cached + 1)
        for seq in filled:
            self.blocks.commit(seq.seq_id, seq.tokens, seq.num_cached)

    def release(self, seq: Sequence) -> None:
        if seq.blocks is not None:
            self.blocks.free(seq.seq_id)
            seq.blocks = None
