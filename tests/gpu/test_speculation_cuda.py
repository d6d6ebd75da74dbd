"""Every drafting method on CUDA: greedy output with speculation equals plain greedy decoding.

The tiny demo family and its heads come from $OUTRIDER_HOME (built on first use, or carried
to the GPU machine prebuilt: see tests/gpu/run_device_checks.sh). The runner and every
proposer live on the GPU, so this covers the CUDA paths of tree building, target features,
Triton verification (the engine's backend on CUDA) and KV compaction end to end.

fp32 with TF32 off: a verify forward of a tree and a 1-token decode run different GEMM
shapes, and TF32's 10-bit mantissa could flip a near-tied argmax between them.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

METHODS = ["ngram", "suffix", "draft_model", "eagle3", "peagle", "medusa", "mtp"]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoTokenizer

    from outrider.benchmarks.prompts import load_prompts
    from outrider.demo.family import ensure_demo_family
    from outrider.target_worker.runner import ModelRunner

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    family = ensure_demo_family("tiny", progress=False)
    tokenizer = AutoTokenizer.from_pretrained(family.tokenizer_dir)
    prompts = [p.token_ids for p in load_prompts("mid", tokenizer, count=4, prompt_tokens=48)]
    runner = ModelRunner.from_pretrained(
        family.target_dir, max_model_len=256, kv_cache_rows=4 * 256, device="cuda"
    )
    return family, prompts, runner


def _generate(runner, prompts, source):
    from outrider.proto import TreeBudget
    from outrider.target_worker.engine import Engine
    from outrider.target_worker.sequence import RequestParams

    engine = Engine(runner, source, eos_token_id=None, max_batch=4, tree_budget=TreeBudget(16, 5, 4))
    completions = engine.generate(prompts, RequestParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    return [c.token_ids for c in completions], engine.stats


@pytest.mark.parametrize("method", METHODS)
def test_greedy_speculation_equals_plain_on_cuda(setup, method):
    from outrider.draft_worker import build_proposer
    from outrider.draft_worker.training.demo_heads import ensure_demo_heads, head_methods
    from outrider.target_worker.draft_source import InProcessDraftSource

    family, prompts, runner = setup
    config = {"method": method, "num_speculative_tokens": 4}
    if method == "draft_model":
        config["model"] = str(family.draft_dir)
    elif method in head_methods():
        config["model"] = str(ensure_demo_heads(family, [method], progress=False)[method])
    if method != "ngram":
        config |= {"tree_top_k": 2, "tree_max_nodes": 12}
    proposer = build_proposer(config, vocab_size=runner.model.vocab_size, device="cuda")
    plain, _ = _generate(runner, prompts, None)
    speculative, stats = _generate(runner, prompts, InProcessDraftSource(proposer))
    assert speculative == plain
    assert stats.num_trees > 0 and stats.num_invalid_trees == 0
    assert stats.spec.num_accepted_tokens > 0  # the drafts were used, not just sent
