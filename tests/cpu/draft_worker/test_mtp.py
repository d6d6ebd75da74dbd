"""`mtp`: the checkpoint's own MTP module drafts (DeepSeek-V3 and a Llama-block demo head).

transformers does not model the MTP layer, so the module is checked against a reference
written from its definition (enorm / hnorm / eh_proj, then transformers' own decoder layer
loaded with the MTP weights, then the shared head), chains and every q row of a tree alike;
drafting through the engine is checked to be lossless (greedy with `mtp` == plain greedy,
chains and trees), and sampled trees statistically (the first two output tokens follow the
target). Through the gRPC draft server: tests/cpu/target_worker/test_draft_client.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from deepseek_testlib import save_random_deepseek
from safetensors.torch import load_file

from outrider.draft_worker import build_proposer
from outrider.kernels import draw_verify_randoms, pack_trees, process_logits, verify
from outrider.proto import DraftSampling, FeatureSpec, SamplingParams, SequenceUpdate, TreeBudget, check_trees
from outrider.target_worker.batch import SequenceChunk, build_forward_batch
from outrider.target_worker.draft_source import InProcessDraftSource
from outrider.target_worker.engine import Engine
from outrider.target_worker.kv_cache import KVCache
from outrider.target_worker.layers.attention import plan_attention
from outrider.target_worker.runner import ModelRunner
from outrider.target_worker.sequence import RequestParams

VOCAB, LAYERS = 97, 3


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_block(cfg, tensors: dict[str, torch.Tensor], layer: int):
    """transformers' DeepseekV3DecoderLayer holding the MTP layer's block weights."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    cfg._attn_implementation = "eager"
    block = ds.DeepseekV3DecoderLayer(cfg, layer).eval()
    prefix = f"model.layers.{layer}."
    state = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
    experts = range(cfg.n_routed_experts)
    state["mlp.experts.gate_up_proj"] = torch.stack(
        [
            torch.cat(
                [state.pop(f"mlp.experts.{e}.gate_proj.weight"), state.pop(f"mlp.experts.{e}.up_proj.weight")]
            )
            for e in experts
        ]
    )
    state["mlp.experts.down_proj"] = torch.stack(
        [state.pop(f"mlp.experts.{e}.down_proj.weight") for e in experts]
    )
    mtp = {
        k: state.pop(k)
        for k in list(state)
        if k.split(".")[0] in ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")
    }
    block.load_state_dict(state)
    return block, mtp, ds.DeepseekV3RotaryEmbedding(cfg)


def reference_mtp(reference, tokens: list[int], hidden: torch.Tensor):
    """Rows p = (t_p, hidden[p]) at positions 0..n-1, causal: (logits [n, V], y [n, H])."""
    block, w, rotary = reference
    ids = torch.tensor(tokens)
    x = torch.cat([rms(w["embed_tokens.weight"][ids], w["enorm.weight"]), rms(hidden, w["hnorm.weight"])], -1)
    x = (x @ w["eh_proj.weight"].T)[None]
    n = len(tokens)
    positions = torch.arange(n)[None]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        x = block(x, attention_mask=mask, position_ids=positions, position_embeddings=rotary(x, positions))[0]
    y = rms(x, w["shared_head.norm.weight"])
    return y @ w["shared_head.head.weight"].T, y


def target_hidden(model, tokens: list[int]) -> torch.Tensor:
    """The target's final hidden state after its final norm, [n, H]."""
    with torch.no_grad():
        return model.model(torch.tensor([tokens])).last_hidden_state[0]


def test_drafts_match_the_reference_module(tmp_path):
    path = tmp_path / "ds"
    model = save_random_deepseek(path, with_mtp=True)
    proposer = build_proposer(
        {"method": "mtp", "model": str(path), "num_speculative_tokens": 3}, vocab_size=VOCAB
    )
    assert proposer.feature_spec == FeatureSpec(layer_ids=(LAYERS,), hidden_size=64, dtype="float32")
    tokens = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(0)).tolist()
    h = target_hidden(model, tokens)
    features = torch.cat([torch.zeros(1, 64), h[:-1]])  # row j: the state before token j
    budget = TreeBudget(max_nodes=4, max_depth=3, top_k=1)
    update = SequenceUpdate(7, 1, torch.tensor(tokens), SamplingParams(), budget, features=features)
    tree = proposer.propose([update])[0]
    reference = reference_block(model.config, load_file(path / "model.safetensors"), LAYERS)
    # Logits of every prefilled row match the reference, not just the argmax.
    logits, _ = reference_mtp(reference, tokens, features)
    first = logits
    cache = KVCache(proposer.cache.spec, 16)
    batch = build_forward_batch([SequenceChunk(0, 0, torch.tensor(tokens), all_logits=True)])
    ours, _ = proposer.module.forward(batch, features, plan_attention(batch), cache.layers[0])
    assert (ours - logits).abs().max() <= 1e-4
    # Reference chain: the module reused with its own output y standing in for the target state.
    drafts, rows, inputs = [], list(tokens), features
    for _ in range(3):
        logits, y = reference_mtp(reference, rows, inputs)
        drafts.append(int(logits[-1].argmax()))
        rows, inputs = rows + drafts[-1:], torch.cat([inputs, y[-1:]])
    assert tree.tokens.tolist() == [tokens[-1], *drafts]
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    # The q of draft 1 is the reference softmax's top probability.
    assert abs(float(tree.q_probs[0, 0]) - float(F.softmax(first[-1], -1).max())) < 1e-4
    # Next round, the committed rows are extended with the target's real features.
    more = torch.randint(0, VOCAB, (2,), generator=torch.Generator().manual_seed(1)).tolist()
    h = target_hidden(model, tokens + more)
    update = SequenceUpdate(
        7, 2, torch.tensor(more), SamplingParams(), budget, features=h[len(tokens) - 1 : -1]
    )
    tree = proposer.propose([update])[0]
    logits, _ = reference_mtp(reference, tokens + more, torch.cat([torch.zeros(1, 64), h[:-1]]))
    assert int(tree.tokens[1]) == int(logits[-1].argmax())


TREE_KEYS = {"tree_top_k": 3, "tree_max_nodes": 8}


def reference_path_logits(reference, tokens: list[int], features: torch.Tensor, path: list[int]):
    """[V] logits after `path` below the root: the module reused with its own y as the input
    hidden of every draft row."""
    rows, inputs = list(tokens), features
    for token in path:
        _, y = reference_mtp(reference, rows, inputs)
        rows, inputs = rows + [token], torch.cat([inputs, y[-1:]])
    return reference_mtp(reference, rows, inputs)[0][-1]


def path_to(tree, node: int) -> list[int]:
    parents, tokens, path = tree.parents.tolist(), tree.tokens.tolist(), []
    while node > 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


def test_tree_q_rows_match_the_reference_module(tmp_path):
    """Every q row of a batch of greedy and sampled trees is the reference module's
    distribution at that node's path, after the sequence's sampling params."""
    path = tmp_path / "ds"
    model = save_random_deepseek(path, with_mtp=True)
    proposer = build_proposer(
        {
            "method": "mtp",
            "model": str(path),
            "num_speculative_tokens": 4,
            "tree_top_k": 2,
            "tree_max_nodes": 10,
        },
        vocab_size=VOCAB,
    )
    reference = reference_block(model.config, load_file(path / "model.safetensors"), LAYERS)
    gen = torch.Generator().manual_seed(4)
    contexts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (9, 4, 6)]
    samplings = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=5), SamplingParams()]
    budget = TreeBudget(max_nodes=10, max_depth=4, top_k=2)
    updates, features = [], []
    for i, (tokens, sampling) in enumerate(zip(contexts, samplings, strict=True)):
        features.append(torch.cat([torch.zeros(1, 64), target_hidden(model, tokens)[:-1]]))
        updates.append(SequenceUpdate(i, 1, torch.tensor(tokens), sampling, budget, features=features[-1]))
    trees = proposer.propose(updates)
    assert check_trees(trees, [budget] * 3, VOCAB) == [None] * 3
    assert proposer.forwards == 4  # one prefill and one forward per expanded depth, for the batch
    for tree, tokens, feats, sampling in zip(trees, contexts, features, samplings, strict=True):
        # Rows at depth 2 and deeper too: their input hidden is their parent row's y.
        assert tree.num_nodes == 10 and max(len(path_to(tree, n)) for n in tree.q_nodes.tolist()) >= 2
        for node, ids, probs in zip(tree.q_nodes.tolist(), tree.q_token_ids, tree.q_probs, strict=True):
            logits = reference_path_logits(reference, tokens, feats, path_to(tree, node))[None]
            if sampling.greedy:
                q = logits.softmax(-1)[0]
            else:
                s = sampling
                q = process_logits(
                    logits, *(torch.tensor([v]) for v in (s.temperature, s.top_k, s.top_p, s.min_p))
                )
                q = q[0]
            expect_probs, expect_ids = q.topk(2)
            expect_probs = expect_probs[expect_probs > 0]
            if not sampling.greedy:
                expect_probs = expect_probs / expect_probs.sum()
            kept = ids >= 0
            assert set(ids[kept].tolist()) == set(expect_ids[: len(expect_probs)].tolist())
            torch.testing.assert_close(
                probs[kept].sort().values, expect_probs.sort().values, atol=1e-4, rtol=1e-3
            )


@pytest.mark.parametrize("shape", [{}, TREE_KEYS], ids=["chain", "tree"])
def test_greedy_with_mtp_equals_plain_deepseek(tmp_path, shape):
    path = tmp_path / "ds"
    save_random_deepseek(path, with_mtp=True)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 11, 8)]
    params = RequestParams(max_tokens=20, ignore_eos=True)
    budget = TreeBudget(max_nodes=8, max_depth=3, top_k=3 if shape else 1)

    def engine(spec):
        runner = ModelRunner.from_pretrained(path, max_model_len=64, kv_cache_rows=512)
        source = InProcessDraftSource(build_proposer(spec, vocab_size=VOCAB)) if spec else None
        return Engine(runner, source, eos_token_id=None, max_batch=4, tree_budget=budget)

    plain = [c.token_ids for c in engine(None).generate(prompts, params)]
    spec_engine = engine({"method": "mtp", "model": str(path), "num_speculative_tokens": 3, **shape})
    assert [c.token_ids for c in spec_engine.generate(prompts, params)] == plain
    stats = spec_engine.stats
    assert stats.num_invalid_trees == 0 and stats.spec.num_drafts > 0


NUM_DRAWS, DELTA, SMALL_VOCAB = 12_000, 1e-6, 12


@pytest.mark.parametrize("mode", ["with_replacement", "without_replacement", "deterministic"])
def test_sampled_trees_are_lossless(tmp_path, mode):
    """The first two output tokens of a round follow the target: p(x1) p(x2 | x1).

    NUM_DRAWS sequences share a context and its features, so each draws a fresh tree from the
    same q rows; the target's p at any node is a bigram row of the node's token (processed
    like the sequence's p), partly agreeing with the module's root distribution. Where the
    round ends after x1, x2 is drawn from p(. | x1) as the next round would. TV over V^2 cells
    as in test_tree_lossless.py.
    """
    torch.manual_seed(0)
    path = tmp_path / "ds"
    save_random_deepseek(path, with_mtp=True, vocab_size=SMALL_VOCAB)
    keys = {"max_model_len": 8, "kv_cache_rows": NUM_DRAWS * 16, "draft_sampling": mode, **TREE_KEYS}
    proposer = build_proposer(
        {"method": "mtp", "model": str(path), "num_speculative_tokens": 3, **keys}, vocab_size=SMALL_VOCAB
    )
    context, features = [3, 5, 7], torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    cache = KVCache(proposer.cache.spec, 8)
    batch = build_forward_batch([SequenceChunk(0, 0, torch.tensor(context))])
    draft_logits, _ = proposer.module.forward(batch, features, plan_attention(batch), cache.layers[0])
    table = torch.randn(SMALL_VOCAB, SMALL_VOCAB, generator=torch.Generator().manual_seed(9)) * 0.7
    table += draft_logits[-1]
    sampling = SamplingParams(temperature=0.9, top_p=0.9)
    ones = torch.ones(SMALL_VOCAB)
    p = process_logits(table, ones * sampling.temperature, None, ones * sampling.top_p)  # [V, V]

    budget = TreeBudget(max_nodes=8, max_depth=3, top_k=3)
    trees = proposer.propose(
        [
            SequenceUpdate(i, 0, torch.tensor(context), sampling, budget, features=features)
            for i in range(NUM_DRAWS)
        ]
    )
    assert trees[0].sampling == DraftSampling[mode.upper()] and trees[0].num_nodes == 8
    packed = pack_trees(trees)
    randoms = draw_verify_randoms(packed.cu_num_draft_tokens, SMALL_VOCAB, torch.Generator().manual_seed(2))
    out = verify(
        packed, p[packed.token_ids], torch.zeros(NUM_DRAWS, dtype=torch.bool), randoms, backend="torch"
    )
    first = out.output_token_ids[:, 0]
    second = torch.where(
        out.num_output_tokens >= 2,
        out.output_token_ids[:, 1],
        torch.multinomial(p[first], 1, generator=torch.Generator().manual_seed(3)).squeeze(1),
    )
    cells = SMALL_VOCAB * SMALL_VOCAB
    joint = torch.bincount(first * SMALL_VOCAB + second, minlength=cells).double() / NUM_DRAWS
    expected = (p[context[-1]][:, None] * p).reshape(-1).double()
    bound = math.sqrt(2 * (cells * math.log(2) + math.log(1 / DELTA)) / NUM_DRAWS) / 2
    assert 0.5 * float((joint - expected).abs().sum()) < bound
    assert float((out.num_output_tokens >= 3).float().mean()) > 0.01  # depth-2 residuals were exercised


def head_state(folder, layer: int) -> dict[str, torch.Tensor]:
    """A saved MTP folder's tensors under `MTPHead`'s own parameter names."""
    rename = {
        "enorm.weight": "enorm",
        "hnorm.weight": "hnorm",
        "shared_head.norm.weight": "head_norm",
        "shared_head.head.weight": "head",
        "embed_tokens.weight": "embed",
        "eh_proj.weight": "eh_proj.weight",
    }
    prefix = f"model.layers.{layer}."
    state = {}
    for name, t in load_file(folder / "model.safetensors").items():
        short = name.removeprefix(prefix)
        state[rename.get(short, "block." + short)] = t
    return state


def test_trained_demo_style_head_on_a_llama_target(tmp_path):
    """The trainer's head for a frozen Llama target: loss falls, the saved folder (MTP names
    only, no target weights) loads into `mtp` with the same logits, and drafting is lossless."""
    from target_runner_testlib import save_random_checkpoint

    from outrider.draft_worker.training import TrainArgs
    from outrider.draft_worker.training.data import DistillData
    from outrider.draft_worker.training.mtp import MTPHead, mtp_inputs, train_mtp

    target, out = tmp_path / "llama", tmp_path / "mtp"
    model = save_random_checkpoint(target, "llama")
    config = model.config.to_dict()
    tokens = torch.randint(0, VOCAB, (16, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = model.model(tokens).last_hidden_state
    data = DistillData(tokens, {4: hidden}, model.lm_head.weight.detach(), 0, 4, config)
    args = TrainArgs("mtp", str(target), str(out), steps=40, batch_size=4, lr=3e-3, progress=False)
    metrics = train_mtp(args, data)
    assert metrics["final_loss"] < metrics["first_loss"] - 0.3, metrics
    assert not any(
        k.startswith("model.embed") or k == "lm_head.weight" for k in load_file(out / "model.safetensors")
    )

    proposer = build_proposer(
        {"method": "mtp", "model": str(out), "num_speculative_tokens": 2}, vocab_size=VOCAB
    )
    head = MTPHead(config, model.model.embed_tokens.weight, model.lm_head.weight)
    head.load_state_dict(head_state(out, 4))
    with torch.no_grad():
        expected = head(tokens[:1], mtp_inputs(tokens[:1], hidden[:1]))[0]
    cache = KVCache(proposer.cache.spec, 32)
    batch = build_forward_batch([SequenceChunk(0, 0, tokens[0], all_logits=True)])
    ours, _ = proposer.module.forward(
        batch, mtp_inputs(tokens[:1], hidden[:1])[0], plan_attention(batch), cache.layers[0]
    )
    assert (ours - expected).abs().max() <= 1e-4

    prompts = [tokens[i, :n].tolist() for i, n in ((1, 6), (2, 12))]
    params = RequestParams(max_tokens=16, ignore_eos=True)

    def engine(spec):
        runner = ModelRunner.from_pretrained(target, max_model_len=64, kv_cache_rows=256)
        source = InProcessDraftSource(build_proposer(spec, vocab_size=VOCAB)) if spec else None
        return Engine(runner, source, eos_token_id=None, max_batch=4)

    plain = [c.token_ids for c in engine(None).generate(prompts, params)]
    spec_engine = engine({"method": "mtp", "model": str(out), "num_speculative_tokens": 2})
    assert [c.token_ids for c in spec_engine.generate(prompts, params)] == plain
    assert spec_engine.stats.spec.num_drafts > 0


def test_trees_through_the_grpc_draft_server_on_the_demo_head(tiny_family):
    """The tiny family's trained MTP head behind a real draft server: the client expects its
    FeatureSpec, so the engine captures the target's final hidden states and sends them with
    each delta; greedy trees through the wire == plain, and the head's drafts are accepted."""
    from draft_client_testlib import (
        client,
        encode_prompts,
        generate,
        load_runner,
        start_server,
    )

    from outrider.draft_worker.server_cli import build_server_proposer
    from outrider.draft_worker.training.demo_heads import demo_head_dir

    head = demo_head_dir(tiny_family, "mtp", progress=False, log=lambda _: None)
    options = {"num_speculative_tokens": 4, **TREE_KEYS}
    proposer = build_server_proposer("mtp", options, head, tiny_family.tokenizer_dir)
    assert proposer.feature_spec.layer_ids == (
        json.loads((head / "config.json").read_text())["num_hidden_layers"],
    )
    runner, prompts = load_runner(tiny_family.target_dir), encode_prompts(tiny_family.tokenizer_dir)
    plain, _ = generate(runner, prompts)
    server = start_server(tiny_family, "mtp", proposer=proposer)
    source = client(
        tiny_family, [f"127.0.0.1:{server.port}"], round_deadline_s=5.0, features=proposer.feature_spec
    )
    try:
        assert source.wait_ready(10)
        outputs, stats = generate(runner, prompts, source)
        assert outputs == plain
        assert stats.num_invalid_trees == 0 and source.counters.trees_missing == 0
        assert stats.spec.num_accepted_tokens > 0, stats.spec
        wide = stats.spec.num_draft_tokens / stats.spec.num_drafts
        assert wide > 4, stats.spec  # trees (the engine's budget: 8 nodes, top_k 2), not chains
    finally:
        source.close()
        server.stop(1)
    assert server.stats.spec_cache_hits == server.stats.spec_cache_misses == 0  # mtp is never speculated
