"""Outrider's draft worker: proposers behind one interface and a registry, and the tree builder.

    proposer.py       the Proposer interface, per-sequence lifecycle, registry, build_proposer,
                      and the `Speculative` protocol the speculation cache drafts through
    config.py         vLLM-style speculative config dicts -> SpeculativeConfig
    ngram.py          `ngram`: prompt lookup (a chain)
    suffix_tree.py    `suffix`: a tree of the most frequent continuations (SuffixDecoding)
    model_drafting.py what the model-based proposers share: chains, scratch KV rows for trees
    draft_model.py    `draft_model`: an independent small LM on the target runner's model code
    eagle3.py, peagle.py, mtp.py, medusa/   the head-based methods
    tree_builder.py   EAGLE-2 dynamic trees over any batched logits callback
    speculation/      the speculation cache, server half: pre-drafting the next round
    server/           the gRPC draft server; server_cli.py its `outrider draft-server` parser

Importing the package is cheap (no torch): the names below load on first use, and the
registry imports the built-in methods the first time it is asked about methods, so the CLI's
`--help` does not pay for torch.
"""

import importlib

_EXPORTS = {
    "SpeculativeConfig": "outrider.draft_worker.config",
    "Proposer": "outrider.draft_worker.proposer",
    "build_proposer": "outrider.draft_worker.proposer",
    "known_methods": "outrider.draft_worker.proposer",
    "parse_speculative_config": "outrider.draft_worker.proposer",
    "register_proposer": "outrider.draft_worker.proposer",
    "root_only_tree": "outrider.draft_worker.proposer",
    "Frontier": "outrider.draft_worker.tree_builder",
    "LogitsFn": "outrider.draft_worker.tree_builder",
    "build_trees": "outrider.draft_worker.tree_builder",
    "draft_generator": "outrider.draft_worker.tree_builder",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'draft_worker' has no attribute {name!r}")
