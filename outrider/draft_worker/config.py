"""Speculative config: vLLM's `speculative_config` keys plus Outrider's tree shape.

    {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    {"method": "draft_model", "num_speculative_tokens": 6, "tree_top_k": 4, "tree_max_nodes": 24}

Common keys (every method):

    method                  registry name, as vLLM spells it (`ngram`, `suffix`, `draft_model`, ...)
    num_speculative_tokens  draft tokens on the longest path (vLLM's K); the default tree depth
    tree_max_depth          default: num_speculative_tokens
    tree_top_k              children per node and q row width; default 1 (a chain)
    tree_max_nodes          nodes per tree, root included; default 1 + depth * top_k
    tree_q_width            entries per sparse q row sent with sampled trees (>= top_k);
                            default 32: a sampled child is drawn from a row holding q's 32
                            likeliest tokens, so verification accepts it with probability
                            ~ sum(min(p, q)) rather than p(x) alone (a one-entry row)
    draft_sampling          how model-based proposers draw children at T > 0:
                            "without_replacement" (default), "with_replacement", "deterministic"
    budget_policy           how the target sizes each round's drafts: "adaptive" (default: per
                            sequence and round, up to the tree keys above, 0 when drafting does
                            not pay; outrider/target_worker/spec_policy.py) or "fixed" (always the tree
                            keys above: vLLM's fixed K, for comparisons)

The tree keys give the *default* budget, which is also the most this drafter offers at the
handshake; the engine may send a smaller TreeBudget any round. Every other key belongs to the
method and is parsed by its proposer's `Options` dataclass, so a misspelt key is an error
naming the keys that method accepts rather than a silently ignored setting.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from outrider.proto import DEFAULT_Q_WIDTH, DraftSampling, TreeBudget

COMMON_KEYS = (
    "method",
    "num_speculative_tokens",
    "tree_max_depth",
    "tree_top_k",
    "tree_max_nodes",
    "tree_q_width",
    "draft_sampling",
    "budget_policy",
)
BUDGET_POLICIES = ("adaptive", "fixed")

_SAMPLING_NAMES = {
    "deterministic": DraftSampling.DETERMINISTIC,
    "with_replacement": DraftSampling.WITH_REPLACEMENT,
    "without_replacement": DraftSampling.WITHOUT_REPLACEMENT,
}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    budget: TreeBudget  # the default and largest tree this drafter proposes
    sampled_mode: DraftSampling  # children at T > 0; T = 0 is always DETERMINISTIC top-k
    options: Any  # the method's own Options dataclass instance
    budget_policy: str = "adaptive"  # the target's: one of BUDGET_POLICIES

    @classmethod
    def from_dict(
        cls,
        config: Mapping[str, Any],
        options_type: type,
        default_num_speculative_tokens: int | None = None,
    ) -> SpeculativeConfig:
        """Parse a vLLM-style dict; `options_type` is the method's Options dataclass."""
        method = config["method"]
        option_keys = {f.name for f in dataclasses.fields(options_type)}
        unknown = sorted(set(config) - set(COMMON_KEYS) - option_keys)
        if unknown:
            accepted = ", ".join(sorted(option_keys | set(COMMON_KEYS)))
            raise ValueError(
                f"speculative config for method {method!r}: unknown keys {unknown}; accepted: {accepted}"
            )
        num_tokens = config.get("num_speculative_tokens", default_num_speculative_tokens)
        if num_tokens is None:
            raise ValueError(f"speculative config for method {method!r}: num_speculative_tokens is required")
        depth = config.get("tree_max_depth", num_tokens)
        top_k = config.get("tree_top_k", 1)
        max_nodes = config.get("tree_max_nodes", 1 + depth * top_k)
        q_width = config.get("tree_q_width", DEFAULT_Q_WIDTH)
        for name, value, least in (
            ("num_speculative_tokens", num_tokens, 1),
            ("tree_max_depth", depth, 1),
            ("tree_top_k", top_k, 1),
            ("tree_max_nodes", max_nodes, 2),
            ("tree_q_width", q_width, 1),
        ):
            if not isinstance(value, int) or value < least:
                raise ValueError(f"speculative config: {name} = {value!r} must be an integer >= {least}")
        sampling_name = config.get("draft_sampling", "without_replacement")
        if sampling_name not in _SAMPLING_NAMES:
            raise ValueError(
                f"speculative config: draft_sampling = {sampling_name!r}; use one of {sorted(_SAMPLING_NAMES)}"
            )
        budget_policy = config.get("budget_policy", "adaptive")
        if budget_policy not in BUDGET_POLICIES:
            raise ValueError(
                f"speculative config: budget_policy = {budget_policy!r}; use one of {BUDGET_POLICIES}"
            )
        options = options_type(**{k: v for k, v in config.items() if k in option_keys})
        return cls(
            method=method,
            num_speculative_tokens=num_tokens,
            budget=TreeBudget(max_nodes=max_nodes, max_depth=depth, top_k=top_k, q_width=max(q_width, top_k)),
            sampled_mode=_SAMPLING_NAMES[sampling_name],
            options=options,
            budget_policy=budget_policy,
        )
