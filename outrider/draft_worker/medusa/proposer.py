"""`medusa`: K residual heads on the target's final hidden state and a static tree (arXiv 2401.10774).

    {"method": "medusa", "model": "/path/to/heads", "num_speculative_tokens": 4}                a chain
    {"method": "medusa", "model": ..., "num_speculative_tokens": 4, "tree_top_k": 4,
     "tree_max_nodes": 24}                                                     the best 24-node tree
    {"method": "medusa", "model": ..., "medusa_choices": [[0], [1], [0, 0], ...], ...}   your own tree

Offsets. The hidden state h that the target's LM head turned into the root r also feeds every
Medusa head, and head k (0-based) predicts the token k + 1 places after r:

    target head(h)   -> r            committed: the root, node 0
    medusa head 0(h) -> r+1          depth 1
    medusa head k(h) -> r+k+1        depth k + 1

Under the engine's feature convention (row j of `features` is the target state *before*
new_tokens[j], the one that predicted it), h is the last row of each update: the feature layer
is `num_hidden_layers`, the target's final hidden state after its final norm.

The heads are `heads.MedusaHeads`, read by `checkpoint.load_medusa_heads`; the tree is a
`static_tree.StaticTree`, cut per round to the TreeBudget by priority, prefix-closed.

Children. At T = 0 node (..., r) takes rank r of its head: the tree is DETERMINISTIC. At T > 0
the q of depth d is head d's distribution after the sequence's own temperature/top-k/top-p,
cut to the tree's q_width and renormalised; under the default sampled mode each expanded node
draws its children from that row (without replacement: the sibling of rank order i is draw i),
and a child whose draw does not exist (q has too few tokens) is dropped with its subtree; with
`draft_sampling: deterministic` children are the row's top tokens. Either way the row sent is
the row used, so verification stays lossless. Heads see only h, never the root itself.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from outrider.draft_worker.medusa.checkpoint import load_medusa_heads, target_num_layers
from outrider.draft_worker.medusa.static_tree import StaticTree, best_choices, prior_accuracy
from outrider.draft_worker.proposer import Proposer, register_proposer, root_only_tree
from outrider.draft_worker.sampling import QParams, batch_uniforms, draw
from outrider.draft_worker.tree_builder import draft_generator
from outrider.kernels import process_logits
from outrider.proto import (
    CandidateTree,
    DraftSampling,
    FeatureSpec,
    SamplingParams,
    SequenceUpdate,
    TreeBudget,
)
from outrider.target_worker.loader import DTYPES

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MedusaOptions:
    model: str | None = None  # heads checkpoint folder (FasterDecoding or vLLM layout, safetensors)
    medusa_choices: tuple[tuple[int, ...], ...] | None = None  # the tree as paths; default: best_choices
    dtype: str | None = None  # "float32" | "bfloat16" | "float16"; default: the checkpoint's
    target_num_layers: int | None = None  # when config.json cannot tell (public heads of a hub model)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("medusa: the key 'model' (the heads checkpoint folder) is required")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"medusa: dtype {self.dtype!r}; use one of {sorted(DTYPES)}")
        if self.medusa_choices is not None:  # JSON gives lists; keep the frozen options hashable
            object.__setattr__(self, "medusa_choices", tuple(tuple(p) for p in self.medusa_choices))


@dataclass
class MedusaState:
    generator: torch.Generator | None
    hidden: torch.Tensor | None = None  # [H]; the target state that predicted the current root


@register_proposer("medusa")
class MedusaProposer(Proposer[MedusaState]):
    Options = MedusaOptions

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        options: MedusaOptions = self.config.options
        dtype = DTYPES[options.dtype] if options.dtype else None
        heads, hf_config = load_medusa_heads(options.model, dtype)
        self.heads = heads.to(self.device)
        vocab = int(hf_config.get("vocab_size", 0)) or heads.lm_head.shape[1]
        if vocab != self.vocab_size:
            raise ValueError(
                f"medusa: the heads in {options.model} predict {vocab} tokens, the target has {self.vocab_size}"
            )
        self.num_layers = target_num_layers(hf_config, options.target_num_layers)
        budget = self.config.budget
        if options.medusa_choices is not None:
            full = StaticTree.compile(options.medusa_choices, heads.num_heads)
            self.tree = full.cut(budget)
            if self.tree.num_nodes < full.num_nodes:
                log.warning(
                    "medusa: the configured budget (nodes %d, depth %d, top_k %d) keeps %d of the %d "
                    "medusa_choices nodes; raise num_speculative_tokens / tree_top_k / tree_max_nodes "
                    "to use them all",
                    budget.max_nodes,
                    budget.max_depth,
                    budget.top_k,
                    self.tree.num_nodes,
                    full.num_nodes,
                )
        else:
            accuracy = hf_config.get("medusa_accuracy") or prior_accuracy(heads.num_heads)
            self.tree = StaticTree.compile(best_choices(accuracy[: heads.num_heads], budget), heads.num_heads)
        self._cut: dict[TreeBudget, StaticTree] = {}

    @property
    def feature_spec(self) -> FeatureSpec:
        name = {v: k for k, v in DTYPES.items()}[self.heads.lm_head.dtype]
        return FeatureSpec(layer_ids=(self.num_layers,), hidden_size=self.heads.hidden_size, dtype=name)

    def new_state(self, update: SequenceUpdate) -> MedusaState:
        return MedusaState(draft_generator(update.sampling.seed))

    def extend(self, state: MedusaState, update: SequenceUpdate) -> None:
        if update.finished or update.new_tokens.shape[0] == 0:
            return
        if update.features is None or update.features.shape[0] != update.new_tokens.shape[0]:
            got = "none" if update.features is None else f"{update.features.shape[0]} rows"
            raise ValueError(
                f"medusa: seq {update.seq_id} round {update.round}: {update.new_tokens.shape[0]} new tokens "
                f"need as many rows of the target's final hidden state, got {got}"
            )
        state.hidden = update.features[-1]

    def tree_for(self, budget: TreeBudget) -> StaticTree:
        """The compiled tree cut to `budget` (once per distinct budget)."""
        if budget not in self._cut:
            self._cut[budget] = self.tree.cut(budget)
        return self._cut[budget]

    @torch.inference_mode()
    def draft(self, updates: Sequence[SequenceUpdate], states: Sequence[MedusaState]) -> list[CandidateTree]:
        trees = [self.tree_for(self.budget(u)) for u in updates]
        drafting = [b for b, t in enumerate(trees) if t.num_nodes > 1 and states[b].hidden is not None]
        out: list[CandidateTree | None] = [None] * len(updates)
        if drafting:
            self._draft(updates, states, trees, drafting, out)
        return [tree or root_only_tree(u) for tree, u in zip(out, updates, strict=True)]

    def _draft(
        self,
        updates: Sequence[SequenceUpdate],
        states: Sequence[MedusaState],
        trees: list[StaticTree],
        drafting: list[int],  # positions in `updates` that get a tree
        out: list[CandidateTree | None],  # filled in at those positions
    ) -> None:
        hidden = torch.stack([states[b].hidden for b in drafting]).to(self.device)  # [B', H]
        logits = self.heads(hidden).float()  # [B', K, V_out]
        q_width = max(trees[b].q_width for b in drafting)
        params = [updates[b].sampling for b in drafting]
        if all(s.greedy for s in params):  # plain softmax: only its top entries are needed
            top, ids = logits.topk(q_width, dim=-1)
            weights = (top - logits.logsumexp(-1, keepdim=True)).exp()
        else:
            weights, ids = head_probs(logits, params).topk(q_width, dim=-1)  # [B', K, q_width] each
        if self.heads.token_map is not None:
            ids = self.heads.token_map[ids]
        weights, ids = weights.cpu(), ids.cpu()
        groups: dict[tuple[int, DraftSampling], list[int]] = {}  # same tree and mode: built together
        for i, b in enumerate(drafting):
            mode = DraftSampling.DETERMINISTIC if params[i].greedy else self.config.sampled_mode
            groups.setdefault((id(trees[b]), mode), []).append(i)
        for (_, mode), rows in groups.items():
            members = [drafting[i] for i in rows]
            built = grow_trees(
                trees[members[0]],
                mode,
                [updates[b] for b in members],
                [states[b].generator for b in members],
                weights if len(rows) == len(drafting) else weights[rows],
                ids if len(rows) == len(drafting) else ids[rows],
            )
            for b, tree in zip(members, built, strict=True):
                out[b] = tree


def grow_trees(
    tree: StaticTree,
    mode: DraftSampling,
    updates: Sequence[SequenceUpdate],
    generators: Sequence[torch.Generator | None],
    weights: torch.Tensor,  # [G, K, >= q_width] float32; each head's top q, sorted
    ids: torch.Tensor,  # [G, K, >= q_width] int64
) -> list[CandidateTree]:
    """The static tree filled in for G sequences at once (one sampling mode)."""
    q_width, num_nodes, head, below = tree.q_width, tree.num_nodes, tree.head, tree.below
    weights = weights[:, :, :q_width]
    present = weights > 0  # [G, K, q_width]; q has that many tokens
    ids = torch.where(present, ids[:, :, :q_width], -1)  # tokens q does not have: padding
    if mode == DraftSampling.DETERMINISTIC:
        rows = weights  # top-k children: the q row sent is the head's q itself
        pick = tree.rank  # [N]; node (..., r) takes rank r
        tokens = ids[:, head, pick]  # [G, N]
    else:
        rows = weights / weights.sum(-1, keepdim=True)  # the q the children are drawn from
        draws = draw(mode, ids[:, below], rows[:, below], batch_uniforms(generators, below.shape[0], q_width))
        pick = tree.sibling  # [N]; the i-th sibling (in rank order) takes the i-th draw
        tokens = draws[:, tree.parent_slot, pick.clamp(max=q_width - 1)]  # [G, N]
    tokens[:, 0] = torch.stack([u.new_tokens[-1] for u in updates]).long()
    # A node exists while its head's q has a pick-th token and so does every ancestor's.
    exists = None
    if not bool(present.all()):
        exists = (pick < present.sum(-1)[:, head]) | (tree.depth == 0)  # [G, N]
        for _ in range(tree.max_depth):
            exists &= exists[:, tree.parents.clamp(min=0)]
    q_ids = ids[:, below]  # [G, E, q_width]
    q_probs = torch.where(q_ids >= 0, rows[:, below], 0.0).float()
    out = []
    for g, update in enumerate(updates):
        parents, q_nodes, q_g, ids_g, probs_g = tree.parents, tree.expanded, slice(None), q_ids[g], q_probs[g]
        nodes = tokens[g]
        kept = None if exists is None else exists[g]
        if kept is not None and not bool(kept.all()):  # q rows too short: drop those nodes and subtrees
            local = kept.cumsum(0) - 1
            nodes = nodes[kept]
            parents = torch.where(tree.parents[kept] >= 0, local[tree.parents[kept].clamp(min=0)], -1)
            has_children = torch.zeros(num_nodes, dtype=torch.bool)
            has_children[tree.parents[kept][1:]] = True
            q_g = has_children[tree.expanded]
            q_nodes = local[tree.expanded[q_g]]
            ids_g, probs_g = ids_g[q_g], probs_g[q_g]
        out.append(
            CandidateTree(
                seq_id=update.seq_id,
                round=update.round,
                tokens=nodes,
                parents=parents.clone(),
                q_nodes=q_nodes.clone(),
                q_token_ids=ids_g.contiguous(),
                q_probs=probs_g.contiguous(),
                sampling=mode,
            )
        )
    return out


def head_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[B, K, V] logits -> each head's q under its sequence's SamplingParams (greedy: plain softmax)."""
    batch, num_heads, _ = logits.shape
    q = process_logits(logits.flatten(0, 1), *QParams.of(params, logits.device, repeats=num_heads))
    return q.view(batch, num_heads, -1)
