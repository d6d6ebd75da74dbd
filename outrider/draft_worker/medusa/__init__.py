"""`medusa`: K residual heads on the target's final hidden state and a static tree (arXiv 2401.10774).

    heads.py         MedusaHeads: K ResBlock heads in batched matmuls, one shared lm_head or K
    checkpoint.py    load_medusa_heads: FasterDecoding's and vLLM's layouts (safetensors only)
    static_tree.py   StaticTree: the tree as paths of per-head ranks, compiled to buffers once;
                     best_choices / prior_accuracy pick the paths when none are configured
    proposer.py      MedusaProposer (registered as `medusa`): features in, trees out

The registry imports `proposer`; importing this package alone loads nothing.
"""
