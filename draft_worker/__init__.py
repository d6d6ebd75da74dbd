"""Outrider's draft worker: proposers behind one interface and a registry, and the tree builder.

    proposer.py       the Proposer interface, per-sequence lifecycle, registry, build_proposer
    config.py         vLLM-style speculative config dicts -> SpeculativeConfig
    ngram.py          `ngram`: prompt lookup (a chain)
    suffix_tree.py    `suffix`: a tree of the most frequent continuations (SuffixDecoding)
    tree_builder.py   EAGLE-2 dynamic trees over any batched logits callback

Importing the package registers the built-in methods.
"""

from draft_worker import ngram, suffix_tree  # noqa: F401 - registers `ngram` and `suffix`
from draft_worker.config import SpeculativeConfig
from draft_worker.proposer import Proposer, build_proposer, known_methods, register_proposer, root_only_tree
from draft_worker.tree_builder import Frontier, LogitsFn, build_trees, draft_generator

__all__ = [
    "Frontier",
    "LogitsFn",
    "Proposer",
    "SpeculativeConfig",
    "build_proposer",
    "build_trees",
    "draft_generator",
    "known_methods",
    "register_proposer",
    "root_only_tree",
]
