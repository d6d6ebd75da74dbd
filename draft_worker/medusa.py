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

A head is ResBlock^L then a linear map to the vocabulary, ResBlock(x) = x + SiLU(W x + b), W
zero-initialised (Medusa's own layout). The tree is data (STYLE.md 5): a list of paths of
per-head ranks, `(0, 2)` = the rank-2 token of head 1 under the top token of head 0, compiled
into buffers once (`StaticTree`) and cut per round to the TreeBudget by priority, prefix-closed.
Without `medusa_choices` the tree is the best one for the configured budget under the heads'
measured top-k accuracies (`medusa_accuracy` in config.json, written by training) or a prior.

Children. At T = 0 node (..., r) takes rank r of its head: the tree is DETERMINISTIC. At T > 0
the q of depth d is head d's distribution after the sequence's own temperature/top-k/top-p,
cut to the tree's width and renormalised; under the default sampled mode each expanded node
draws its children from that row (without replacement: the sibling of rank order i is draw i),
and a child whose draw does not exist (q has too few tokens) is dropped with its subtree; with
`draft_sampling: deterministic` children are the row's top tokens. Either way the row sent is
the row used, so verification stays lossless. Heads see only h, never the root itself.

Checkpoints (safetensors only; `.pt`/`.bin` are pickle and refused):

    FasterDecoding  medusa_lm_head.safetensors   {k}.{j}.linear.weight [H, H], {k}.{j}.linear.bias [H]
                                                 (j < medusa_num_layers), {k}.{L}.weight [V, H]
                    config.json                  medusa_num_heads, medusa_num_layers, hidden_size,
                                                 vocab_size, base_model_name_or_path
    vLLM            *.safetensors                blocks.{k}.layers.{j}.weight (+ .bias), lm_heads.{k}.weight
                                                 or one shared lm_head.weight, optional token_map
                    config.json                  num_heads, num_hidden_layers (per head), hidden_size,
                                                 vocab_size, truncated_vocab_size
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from outrider.draft_worker.proposer import Proposer, register_proposer, root_only_tree
from outrider.draft_worker.tree_builder import draft_generator
from outrider.kernels import process_logits
from outrider.proto import CandidateTree, DraftSampling, FeatureSpec, SequenceUpdate, TreeBudget
from outrider.target_worker.loader import DTYPES, CheckpointError, CheckpointReader

log = logging.getLogger(__name__)

HEADS_FILE = "medusa_lm_head.safetensors"
Path_ = tuple[int, ...]  # one tree node: ranks of heads 0, 1, ... on the way from the root


# ---- the heads ------------------------------------------------------------------------------


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


def load_medusa_heads(path: str | Path, dtype: torch.dtype | None = None) -> tuple[MedusaHeads, dict]:
    """(heads, config.json) from a FasterDecoding- or vLLM-layout folder; never reads pickle."""
    path = Path(path)
    pickled = sorted(p.name for p in (*path.glob("*.pt"), *path.glob("*.bin")))
    if pickled and not list(path.glob("*.safetensors")):
        raise CheckpointError(
            f"medusa: {path} holds only pickle weights ({', '.join(pickled)}), which are never loaded; "
            f"convert them once, where you trust the file, to safetensors: "
            f"safetensors.torch.save_file(torch.load(f, weights_only=True), '{HEADS_FILE}')"
        )
    reader = CheckpointReader(path)
    config = reader.config
    dtype = dtype or reader.checkpoint_dtype
    if "medusa_num_heads" in config or reader.has("0.1.weight") or reader.has("medusa_head.0.1.weight"):
        heads = _read_faster_decoding(reader, config, dtype)
    elif "num_heads" in config and reader.has("blocks.0.layers.0.weight"):
        heads = _read_vllm(reader, config, dtype)
    else:
        raise CheckpointError(
            f"medusa: {path} is neither FasterDecoding's layout ('{{k}}.0.linear.weight', "
            "config medusa_num_heads) nor vLLM's ('blocks.{k}.layers.0.weight', config num_heads)"
        )
    if heads.share_identical_heads():
        log.info(
            "medusa: the %d heads of %s share one lm_head; it is read once per round", heads.num_heads, path
        )
    return heads.eval().requires_grad_(False), config


def _read_faster_decoding(reader: CheckpointReader, config: dict, dtype: torch.dtype) -> MedusaHeads:
    layers = int(config.get("medusa_num_layers", 1))
    # Medusa-2 saves the heads inside the whole model, as `medusa_head.{k}...`.
    prefix = "medusa_head." if reader.has(f"medusa_head.0.{layers}.weight") else ""
    num_heads = int(config.get("medusa_num_heads", 0))
    if not num_heads:  # no config count: as many heads as the file holds
        while reader.has(f"{prefix}{num_heads}.{layers}.weight"):
            num_heads += 1
    vocab, hidden = reader.shape(f"{prefix}0.{layers}.weight")
    heads = MedusaHeads(num_heads, layers, hidden, vocab).to(dtype)
    for k in range(num_heads):
        for j in range(layers):
            heads.block_weight.data[k, j] = reader.read(f"{prefix}{k}.{j}.linear.weight", dtype)
            if reader.has(f"{prefix}{k}.{j}.linear.bias"):
                heads.block_bias.data[k, j] = reader.read(f"{prefix}{k}.{j}.linear.bias", dtype)
        heads.lm_head.data[k] = reader.read(f"{prefix}{k}.{layers}.weight", dtype)
    return heads


def _read_vllm(reader: CheckpointReader, config: dict, dtype: torch.dtype) -> MedusaHeads:
    num_heads, layers = int(config["num_heads"]), int(config.get("num_hidden_layers", 1))
    shared = not reader.has("lm_heads.0.weight")
    vocab, hidden = reader.shape("lm_head.weight" if shared else "lm_heads.0.weight")
    heads = MedusaHeads(num_heads, layers, hidden, vocab, shared_head=shared).to(dtype)
    for k in range(num_heads):
        for j in range(layers):
            heads.block_weight.data[k, j] = reader.read(f"blocks.{k}.layers.{j}.weight", dtype)
            if reader.has(f"blocks.{k}.layers.{j}.bias"):
                heads.block_bias.data[k, j] = reader.read(f"blocks.{k}.layers.{j}.bias", dtype)
        if not shared:
            heads.lm_head.data[k] = reader.read(f"lm_heads.{k}.weight", dtype)
    if shared:
        heads.lm_head.data[0] = reader.read("lm_head.weight", dtype)
    if reader.has("token_map"):
        heads.token_map = reader.read("token_map", torch.int64)
    return heads


def target_num_layers(config: dict, options_value: int | None) -> int:
    """The target's layer count L (its final hidden state is feature layer L)."""
    if options_value is not None:
        return options_value
    # FasterDecoding's full configs are the base model's config plus the medusa_* keys (vLLM's
    # num_hidden_layers counts the heads' own blocks instead, so it is not read there).
    if "medusa_num_heads" in config and "num_hidden_layers" in config:
        return int(config["num_hidden_layers"])
    base = config.get("base_model_name_or_path")
    if base and (Path(base) / "config.json").is_file():
        return int(json.loads((Path(base) / "config.json").read_text())["num_hidden_layers"])
    raise ValueError(
        "medusa: cannot tell how many layers the target has (its final hidden state is feature "
        f"layer num_hidden_layers); base_model_name_or_path = {base!r} is not a local folder. "
        "Give the key target_num_layers"
    )


# ---- the static tree ------------------------------------------------------------------------


# Top-k accuracy of head d at rank r when a checkpoint has no measured table (Medusa-1 heads on
# Vicuna-7B are roughly 0.6 / 0.45 / 0.35 / 0.3 at rank 0, each further rank a fraction of that).
def prior_accuracy(num_heads: int, ranks: int = 10) -> list[list[float]]:
    return [
        [0.6 * 0.75**d * (0.35 if r else 1.0) * 0.7 ** max(r - 1, 0) for r in range(ranks)]
        for d in range(num_heads)
    ]


def best_choices(accuracy: Sequence[Sequence[float]], budget: TreeBudget) -> list[Path_]:
    """The max_nodes - 1 paths of highest value (product of accuracy[depth][rank] along the path),
    best first: Medusa's tree search under independent per-head accuracies. Values never grow
    along a path and ties go to the shallower, lower-ranked path, so every prefix of the result
    is prefix-closed."""
    depth, width = min(budget.max_depth, len(accuracy)), budget.top_k
    frontier: list[tuple[float, Path_]] = [(1.0, ())]
    chosen: list[tuple[float, Path_]] = []
    while frontier and len(chosen) < budget.max_nodes - 1:
        value, path = frontier.pop(0)
        if path:
            chosen.append((value, path))
        if len(path) < depth:
            row = accuracy[len(path)]
            frontier += [(value * row[r], (*path, r)) for r in range(min(width, len(row)))]
            frontier.sort(key=lambda item: (-item[0], len(item[1]), item[1]))
    return [path for _, path in chosen]


@dataclass(frozen=True)
class StaticTree:
    """A prefix-closed list of paths laid out as tree buffers; node 0 is the root.

    Layout: by depth, then by ranks, so parents precede children and siblings go in rank order
    (the order the verifier tries them).
    """

    paths: tuple[Path_, ...]  # [N - 1] in priority order (what a smaller budget keeps first)
    parents: torch.Tensor  # [N] int64; -1 for the root
    depth: torch.Tensor  # [N] int64; head of a non-root node = depth - 1
    rank: torch.Tensor  # [N] int64; rank of the node within its head (root: 0)
    sibling: torch.Tensor  # [N] int64; position among its siblings, in rank order
    expanded: torch.Tensor  # [E] int64; nodes with children (each gets a q row)
    width: int  # q row width: the largest rank used + 1
    head: torch.Tensor  # [N] int64; the head a node's token comes from (depth - 1; root: 0)
    below: torch.Tensor  # [E] int64; the head an expanded node's children come from (its depth)
    parent_slot: torch.Tensor  # [N] int64; row in `expanded` of each node's parent (root: 0)
    max_depth: int

    @classmethod
    def compile(cls, choices: Sequence[Sequence[int]], num_heads: int) -> StaticTree:
        given = [tuple(int(r) for r in path) for path in choices]
        position = {}
        for i, path in enumerate(given):
            if not path or min(path) < 0 or len(path) > num_heads:
                raise ValueError(f"medusa_choices: {list(path)} must be 1..{num_heads} ranks >= 0")
            if path in position:
                raise ValueError(f"medusa_choices: {list(path)} appears twice")
            position[path] = i
        for path in given:
            if len(path) > 1 and path[:-1] not in position:
                raise ValueError(f"medusa_choices: {list(path)} comes without its prefix {list(path[:-1])}")
        # Priority = the given order, except that a path waits for its prefixes (published lists
        # need not list prefixes first), so every priority prefix is prefix-closed.
        after = {p: max(position[p[:i]] for i in range(1, len(p) + 1)) for p in given}
        paths = tuple(sorted(given, key=lambda p: (after[p], len(p))))
        layout = [(), *sorted(paths, key=lambda p: (len(p), p))]
        index = {path: i for i, path in enumerate(layout)}
        parents = [-1] + [index[p[:-1]] for p in layout[1:]]
        sibling, seen = [0], {}
        for p in layout[1:]:
            sibling.append(seen.get(p[:-1], 0))
            seen[p[:-1]] = sibling[-1] + 1
        expanded = sorted(set(parents[1:]))
        slot = {node: row for row, node in enumerate(expanded)}
        depth = [len(p) for p in layout]
        return cls(
            paths=paths,
            parents=torch.tensor(parents),
            depth=torch.tensor(depth),
            rank=torch.tensor([p[-1] if p else 0 for p in layout]),
            sibling=torch.tensor(sibling),
            expanded=torch.tensor(expanded, dtype=torch.int64),
            width=1 + max((p[-1] for p in paths), default=-1),
            head=torch.tensor([max(d - 1, 0) for d in depth]),
            below=torch.tensor([depth[u] for u in expanded], dtype=torch.int64),
            parent_slot=torch.tensor([0] + [slot[u] for u in parents[1:]]),
            max_depth=max(depth),
        )

    def cut(self, budget: TreeBudget) -> StaticTree:
        """The paths a smaller budget keeps: in priority order, within depth and rank, prefix-closed."""
        kept: list[Path_] = []
        for path in self.paths:
            if len(kept) == budget.max_nodes - 1:
                break
            fits = len(path) <= budget.max_depth and max(path) < budget.top_k
            if fits and (len(path) == 1 or path[:-1] in kept):
                kept.append(path)
        return StaticTree.compile(kept, max(len(p) for p in self.paths) if self.paths else 1)

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[0]


# ---- the proposer ---------------------------------------------------------------------------


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
        width = max(trees[b].width for b in drafting)
        params = [updates[b].sampling for b in drafting]
        if all(s.greedy for s in params):  # plain softmax: only its top entries are needed
            top, ids = logits.topk(width, dim=-1)
            weights = (top - logits.logsumexp(-1, keepdim=True)).exp()
        else:
            weights, ids = head_probs(logits, params).topk(width, dim=-1)  # [B', K, width] each
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
    weights: torch.Tensor,  # [G, K, >= width] float32; each head's top q, sorted
    ids: torch.Tensor,  # [G, K, >= width] int64
) -> list[CandidateTree]:
    """The static tree filled in for G sequences at once (one sampling mode)."""
    width, num_nodes, head, below = tree.width, tree.num_nodes, tree.head, tree.below
    weights = weights[:, :, :width]
    present = weights > 0  # [G, K, width]; q has that many tokens
    ids = torch.where(present, ids[:, :, :width], -1)  # tokens q does not have: padding
    if mode == DraftSampling.DETERMINISTIC:
        rows = weights  # top-k children: the q row sent is the head's q itself
        pick = tree.rank  # [N]; node (..., r) takes rank r
        tokens = ids[:, head, pick]  # [G, N]
    else:
        rows = weights / weights.sum(-1, keepdim=True)  # the q the children are drawn from
        draws = _draw(mode, ids[:, below], rows[:, below], _uniforms(generators, below.shape[0], width))
        pick = tree.sibling  # [N]; the i-th sibling (in rank order) takes the i-th draw
        tokens = draws[:, tree.parent_slot, pick.clamp(max=width - 1)]  # [G, N]
    tokens[:, 0] = torch.stack([u.new_tokens[-1] for u in updates]).long()
    # A node exists while its head's q has a pick-th token and so does every ancestor's.
    exists = None
    if not bool(present.all()):
        exists = (pick < present.sum(-1)[:, head]) | (tree.depth == 0)  # [G, N]
        for _ in range(tree.max_depth):
            exists &= exists[:, tree.parents.clamp(min=0)]
    q_ids = ids[:, below]  # [G, E, width]
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


def _uniforms(generators: Sequence[torch.Generator | None], rows: int, width: int) -> torch.Tensor:
    """[G, rows, width] uniforms in (0, 1): seeded sequences from their own generator (the same
    draws whatever they are batched with), the rest from torch's global RNG in one call."""
    out = torch.empty(len(generators), rows, width)
    unseeded = [g for g, gen in enumerate(generators) if gen is None]
    if unseeded:
        out[unseeded] = torch.rand(len(unseeded), rows, width)
    for g, gen in enumerate(generators):
        if gen is not None:
            out[g] = torch.rand(rows, width, generator=gen)
    return out.clamp_(min=torch.finfo(torch.float32).tiny)  # Gumbel needs log(u) finite


def _draw(mode: DraftSampling, ids: torch.Tensor, rows: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[G, E, width] ids in draw order from q rows [G, E, width]: without replacement by
    Gumbel-top-k (sorting log q + Gumbel noise), with replacement by inverse CDF."""
    if mode == DraftSampling.WITHOUT_REPLACEMENT:
        keys = rows.log() - (-uniforms.log()).log()
        return ids.gather(-1, keys.argsort(-1, descending=True))
    cdf = rows.cumsum(-1)
    picks = (cdf[..., None, :] <= uniforms[..., None] * cdf[..., -1:, None]).sum(-1)
    return ids.gather(-1, torch.minimum(picks, (rows > 0).sum(-1, keepdim=True) - 1))


def head_probs(logits: torch.Tensor, params: Sequence) -> torch.Tensor:
    """[B, K, V] logits -> each head's q under its sequence's SamplingParams (greedy: plain softmax)."""
    batch, num_heads, _ = logits.shape

    def per_row(values: list) -> torch.Tensor:  # [B * K]
        return torch.tensor(values, device=logits.device).repeat_interleave(num_heads)

    q = process_logits(
        logits.flatten(0, 1),
        per_row([1.0 if s.greedy else s.temperature for s in params]),
        per_row([0 if s.greedy else s.top_k for s in params]),
        per_row([1.0 if s.greedy else s.top_p for s in params]),
        per_row([0.0 if s.greedy else s.min_p for s in params]),
    )
    return q.view(batch, num_heads, -1)
