"""eagle3 and peagle on the tiny demo family: heads trained by `outrider demo build`'s own code
(`draft_worker.training.demo_heads`), served in-process and over gRPC, sampled losslessly, trained
(loss falls, a trained head beats an untrained one on tau, resume replays the same steps),
and published EAGLE-3 layouts (d2t/t2d, no embed_tokens) load while pickle files are refused.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from outrider.draft_worker import build_proposer
from outrider.draft_worker.eagle_head import CheckpointFormatError, EagleHeadConfig
from outrider.draft_worker.server import DraftIdentity, serve
from outrider.draft_worker.server_cli import build_server_proposer
from outrider.draft_worker.training import TrainArgs, train_draft
from outrider.kernels import process_logits
from outrider.proto import Limits, SamplingParams, SequenceUpdate, TreeBudget
from outrider.target_worker.batch import SequenceChunk, build_forward_batch
from outrider.target_worker.draft_client import (
    DraftClientConfig,
    RemoteDraftSource,
    target_handshake,
    tokenizer_fingerprint,
)
from outrider.target_worker.draft_source import InProcessDraftSource
from outrider.target_worker.draft_trust import VerificationMode
from outrider.target_worker.engine import Engine
from outrider.target_worker.runner import ModelRunner
from outrider.target_worker.sequence import RequestParams

PROMPT_TOKENS, NEW_TOKENS = 48, 40
DATA = {"num_sequences": 48, "prompt_tokens": 32, "new_tokens": 64}  # the tiny head recipe's data (cached)


@pytest.fixture(scope="module")
def heads(tiny_family):
    from outrider.draft_worker.training.demo_heads import ensure_demo_heads

    return ensure_demo_heads(tiny_family, ["eagle3", "peagle"], progress=False, log=lambda _: None)


@pytest.fixture(scope="module")
def prompts(tiny_family):
    from transformers import AutoTokenizer

    from outrider.benchmarks.prompts import load_prompts

    tokenizer = AutoTokenizer.from_pretrained(tiny_family.tokenizer_dir)
    return [p.token_ids for p in load_prompts("mid", tokenizer, count=4, prompt_tokens=PROMPT_TOKENS)]


def configs(heads) -> dict[str, dict]:
    eagle = {"method": "eagle3", "model": str(heads["eagle3"]), "num_speculative_tokens": 4}
    peagle = {"method": "peagle", "model": str(heads["peagle"]), "num_speculative_tokens": 4}
    tree = {"tree_top_k": 3, "tree_max_nodes": 12}
    return {
        "eagle3-chain": eagle,
        "eagle3-tree": {**eagle, **tree},
        "eagle3-projected": {**eagle, **tree, "project_features_on_target": True},
        "peagle-chain": peagle,
        "peagle-tree": {**peagle, **tree},
    }


def engine(family, spec: dict | None, max_batch: int = 8, rows: int = 2048, **keys) -> Engine:
    runner = ModelRunner.from_pretrained(family.target_dir, max_model_len=128, kv_cache_rows=rows)
    source = None
    if spec is not None:
        source = InProcessDraftSource(build_proposer({**spec, **keys}, vocab_size=runner.model.vocab_size))
    return Engine(runner, source, eos_token_id=None, max_batch=max_batch, max_prefill_tokens=rows)


def generate(eng: Engine, prompts, params) -> list[list[int]]:
    return [c.token_ids for c in eng.generate(prompts, params)]


@pytest.fixture(scope="module")
def plain(tiny_family, prompts):
    return generate(engine(tiny_family, None), prompts, RequestParams(max_tokens=NEW_TOKENS, ignore_eos=True))


@pytest.mark.parametrize(
    "name", ["eagle3-chain", "eagle3-tree", "eagle3-projected", "peagle-chain", "peagle-tree"]
)
def test_greedy_output_equals_speculation_off(tiny_family, heads, prompts, plain, name):
    eng = engine(tiny_family, configs(heads)[name])
    assert generate(eng, prompts, RequestParams(max_tokens=NEW_TOKENS, ignore_eos=True)) == plain
    stats = eng.stats
    assert stats.num_invalid_trees == 0 and stats.spec.num_drafts > 0
    assert stats.spec.mean_acceptance_length > 1.3, stats.spec.mean_acceptance_length  # trained heads draft


@pytest.mark.parametrize("name", ["eagle3-tree", "eagle3-projected", "peagle-chain"])
def test_greedy_through_the_grpc_draft_server(tiny_family, heads, prompts, plain, name):
    spec = dict(configs(heads)[name])
    method = spec.pop("method")
    spec.pop("model")  # the server gets the head folder as its model, as `--demo` does
    proposer = build_server_proposer(method, spec, heads[method], tiny_family.tokenizer_dir)
    identity = DraftIdentity(
        f"test-{name}", proposer.vocab_size, tokenizer_fingerprint(tiny_family.tokenizer_dir)
    )
    server = serve(proposer, identity, address="127.0.0.1:0", speculation_cache=None)
    request = target_handshake(
        tiny_family.target_dir,
        tiny_family.tokenizer_dir,
        model_id="demo-tiny-target",
        limits=Limits(max_batch=64, max_nodes=16, max_depth=8, max_top_k=4),
    )
    source = RemoteDraftSource(
        [f"127.0.0.1:{server.port}"], request, DraftClientConfig(round_deadline_s=10.0)
    )
    try:
        assert source.wait_ready(10)
        runner = ModelRunner.from_pretrained(tiny_family.target_dir, max_model_len=128, kv_cache_rows=2048)
        eng = Engine(runner, source, eos_token_id=None, max_batch=8, max_prefill_tokens=2048)
        assert generate(eng, prompts, RequestParams(max_tokens=NEW_TOKENS, ignore_eos=True)) == plain
        assert eng.stats.spec.mean_acceptance_length > 1.3 and eng.stats.num_invalid_trees == 0
    finally:
        source.close()
        server.stop(1)


@pytest.mark.parametrize("name", ["eagle3-tree", "peagle-tree"])
def test_seeded_sampling_is_reproducible(tiny_family, heads, prompts, name):
    params = [
        RequestParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=s, ignore_eos=True) for s in range(4)
    ]
    first = generate(engine(tiny_family, configs(heads)[name]), prompts, params)
    assert generate(engine(tiny_family, configs(heads)[name]), prompts, params) == first


def target_probs(family, sequences: list[list[int]], start: int, count: int) -> torch.Tensor:
    """[N, count, vocab]: the target's p (T = 1) of token start + j given the tokens before it."""
    n, length = len(sequences), len(sequences[0])
    runner = ModelRunner.from_pretrained(family.target_dir, max_model_len=length, kv_cache_rows=n * length)
    chunks = [
        SequenceChunk(runner.cache.allocate(i, length), 0, torch.tensor(s), all_logits=True)
        for i, s in enumerate(sequences)
    ]
    logits = runner.forward(build_forward_batch(chunks)).logits.view(n, length, -1)
    logits = logits[:, start - 1 : start - 1 + count].reshape(n * count, -1)
    return process_logits(logits, torch.ones(n * count)).view(n, count, -1)


@pytest.mark.parametrize("name", ["eagle3-tree", "peagle-tree"])
def test_sampled_tokens_follow_the_target(tiny_family, heads, prompts, name):
    """As test_engine_drafting's check: N seeded sequences sample K tokens from one prompt;
    given the prefixes drawn, the j-th tokens are independent draws from the target's p_i, so
    on each of the 15 likeliest tokens of pbar the frequency is within Hoeffding's eps of
    pbar (all 60 sets at once except with probability delta). The drafter must also have been
    used (its trees accepted tokens), or the test would only check plain sampling."""
    n, k, delta = 600, 4, 1e-3
    prompt = prompts[2][:24]
    params = [RequestParams(max_tokens=k, temperature=1.0, seed=s, ignore_eos=True) for s in range(n)]
    eng = engine(tiny_family, configs(heads)[name], max_batch=n, rows=n * 48)
    out = torch.tensor(generate(eng, [prompt] * n, params))  # [N, K]
    assert eng.stats.spec.num_accepted_tokens >= 20, eng.stats.spec  # measured 34-37 (tiny heads, T = 1)
    assert eng.trust.mode == VerificationMode.DRAFT_Q and eng.trust.audited_children > 0  # honest: kept
    sequences = [prompt + row[:-1] for row in out.tolist()]
    p_bar = target_probs(tiny_family, sequences, len(prompt), k).mean(0)  # [K, V]
    freq = torch.zeros_like(p_bar).scatter_add_(1, out.T, torch.ones(k, n)) / n
    top = p_bar.topk(15, dim=1).indices
    eps = math.sqrt(math.log(2 * k * 15 / delta) / (2 * n))
    gap = (freq.gather(1, top) - p_bar.gather(1, top)).abs()
    assert bool((gap <= eps).all()), (gap.max(), eps)


# ---- training -----------------------------------------------------------------------------


def train(family, tmp_path, method: str, steps: int, **changes) -> dict:
    args = TrainArgs(
        method=method,
        target_dir=str(family.target_dir),
        out_dir=str(tmp_path / method),
        steps=steps,
        data_cache_dir=str(family.root.parent / "distill"),
        progress=False,
        method_options={"draft_vocab_size": 1024, "ttt_steps": 3, "parallel_depth": 4},
        **DATA,
    )
    for key, value in changes.items():
        setattr(args, key, value)
    return train_draft(args)


def tau(family, spec, prompts) -> float:
    eng = engine(family, spec)
    generate(eng, prompts, RequestParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    return eng.stats.spec.mean_acceptance_length


@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_training_lowers_the_loss_and_beats_an_untrained_head(tiny_family, heads, prompts, tmp_path, method):
    untrained = train(tiny_family, tmp_path / "untrained", method, steps=0)
    assert untrained["losses"] == []
    trained = json.loads((heads[method] / "manifest.json").read_text())["metrics"]
    assert trained["final_loss"] < 0.95 * trained["first_loss"], (
        trained
    )  # measured -8% (peagle), -12% (eagle3)
    spec = {"method": method, "num_speculative_tokens": 4}
    before = tau(tiny_family, {**spec, "model": str(tmp_path / "untrained" / method)}, prompts)
    after = tau(tiny_family, {**spec, "model": str(heads[method])}, prompts)
    assert after > before, (before, after)


def test_resume_continues_from_the_saved_step(tiny_family, tmp_path):
    whole = train(tiny_family, tmp_path / "whole", "eagle3", steps=8)
    first = train(tiny_family, tmp_path / "split", "eagle3", steps=8, stop_after=5)
    assert first["start_step"] == 0 and len(first["losses"]) == 5
    resumed = train(tiny_family, tmp_path / "split", "eagle3", steps=8, resume=True)
    assert resumed["start_step"] == 5 and len(resumed["losses"]) == 8
    # Same weights, AdamW moments and per-step batches as the uninterrupted run: the same losses.
    assert resumed["losses"] == pytest.approx(whole["losses"], rel=1e-4, abs=1e-4)


# ---- published layouts ------------------------------------------------------------------------


def write_published_eagle3(folder, target_dir, draft_ids: torch.Tensor, *, fmt: str = "safetensors") -> None:
    """A tiny random head in the layout of yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: LlamaForCausalLMEagle3
    config with draft_vocab_size, keys fc / midlayer.* / norm / lm_head / d2t / t2d, no embed_tokens."""
    target = json.loads((target_dir / "config.json").read_text())
    h, v, vd, heads_, ffn = target["hidden_size"], target["vocab_size"], draft_ids.numel(), 4, 96
    folder.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": h,
        "intermediate_size": ffn,
        "num_attention_heads": heads_,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 128,
        "vocab_size": v,
        "draft_vocab_size": vd,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    d = h // heads_
    tensors = {
        "fc.weight": torch.randn(h, 3 * h, generator=g) * 0.05,
        "midlayer.hidden_norm.weight": torch.ones(h),
        "midlayer.input_layernorm.weight": torch.ones(h),
        "midlayer.post_attention_layernorm.weight": torch.ones(h),
        "midlayer.self_attn.q_proj.weight": torch.randn(heads_ * d, 2 * h, generator=g) * 0.05,
        "midlayer.self_attn.k_proj.weight": torch.randn(2 * d, 2 * h, generator=g) * 0.05,
        "midlayer.self_attn.v_proj.weight": torch.randn(2 * d, 2 * h, generator=g) * 0.05,
        "midlayer.self_attn.o_proj.weight": torch.randn(h, heads_ * d, generator=g) * 0.05,
        "midlayer.mlp.gate_proj.weight": torch.randn(ffn, h, generator=g) * 0.05,
        "midlayer.mlp.up_proj.weight": torch.randn(ffn, h, generator=g) * 0.05,
        "midlayer.mlp.down_proj.weight": torch.randn(h, ffn, generator=g) * 0.05,
        "norm.weight": torch.ones(h),
        "lm_head.weight": torch.randn(vd, h, generator=g),
        "d2t": draft_ids - torch.arange(vd),
        "t2d": torch.zeros(v, dtype=torch.bool).index_fill_(0, draft_ids, True),
    }
    if fmt == "safetensors":
        save_file(tensors, str(folder / "model.safetensors"))
    else:  # only the file name matters: the loader must refuse before reading it
        (folder / "pytorch_model.bin").write_bytes(b"not read")


def test_a_published_eagle3_layout_loads_and_maps_draft_ids_through_d2t(tiny_family, tmp_path):
    draft_ids = torch.arange(7, 2048, 5)  # every 5th target id from 7: d2t offsets grow along the vocabulary
    write_published_eagle3(tmp_path / "head", tiny_family.target_dir, draft_ids)
    spec = {"method": "eagle3", "model": str(tmp_path / "head"), "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="target_model"):  # no embed_tokens and no target to read them from
        build_proposer(spec, vocab_size=2048)
    proposer = build_proposer({**spec, "target_model": str(tiny_family.target_dir)}, vocab_size=2048)
    assert proposer.feature_spec.layer_ids == (0, 1, 2)  # eagle3_layer_ids(2), from the target's config
    assert torch.equal(proposer.draft_ids, draft_ids)
    update = SequenceUpdate(
        seq_id=1,
        round=0,
        new_tokens=torch.tensor([5, 9, 11]),
        sampling=SamplingParams(),
        budget=TreeBudget(max_nodes=4, max_depth=3, top_k=1),
        features=torch.randn(3, 3 * 64),
        reset=True,
    )
    (tree,) = proposer.propose([update])
    drafted = tree.tokens[1:]
    assert drafted.numel() == 3 and bool(torch.isin(drafted, draft_ids).all())  # only draft-vocabulary ids
    cfg = EagleHeadConfig.from_hf(json.loads((tmp_path / "head" / "config.json").read_text()))
    assert (cfg.draft_vocab_size, cfg.vocab_size) == (draft_ids.numel(), 2048)
    # The greedy root child is the target id of the head's best draft id.
    best = int(proposer.head.logits(_root_hidden(proposer, update)).argmax())
    assert int(drafted[0]) == best + int(proposer.head.d2t[best])


def _root_hidden(proposer, update) -> torch.Tensor:
    """Re-runs the root row on a fresh sequence (the cache rows are rewritten identically)."""
    fresh = SequenceUpdate(**{**update.__dict__, "seq_id": 2})
    state = proposer.new_state(fresh)
    proposer.extend(state, fresh)
    assert proposer._admit(state)
    return proposer._prefill([state])


def test_pickle_checkpoints_are_refused(tiny_family, tmp_path):
    write_published_eagle3(tmp_path / "head", tiny_family.target_dir, torch.arange(64), fmt="bin")
    with pytest.raises(CheckpointFormatError, match="pickle"):
        build_proposer(
            {
                "method": "eagle3",
                "model": str(tmp_path / "head"),
                "target_model": str(tiny_family.target_dir),
                "num_speculative_tokens": 2,
            },
            vocab_size=2048,
        )
