"""The replay drafter (outrider/benchmarks/replay_drafter.py) drafts with the acceptance it is told.

At T = 0 each of its draft tokens is the target's own next token with probability a, so a
K-chain keeps (1 - a^(K+1)) / (1 - a) tokens per round on average; greedy output stays
plain greedy output, and a bad option is refused clearly.
"""

from __future__ import annotations

import json

import pytest

from outrider.benchmarks.replay_drafter import registered
from outrider.draft_worker import build_proposer
from outrider.target_worker.draft_source import InProcessDraftSource
from outrider.target_worker.engine import Engine
from outrider.target_worker.runner import ModelRunner
from outrider.target_worker.sequence import RequestParams

PROMPTS = [[5, 9, 11, 40, 7, 8, 9, 10], [300, 301, 17, 17, 18], [1000, 12, 13, 14, 15, 16]]
NEW_TOKENS = 60


@pytest.fixture(scope="module", autouse=True)
def replay_method():
    """Registered for this module only: other tests list the registered methods and serve each."""
    with registered():
        yield


@pytest.fixture(scope="module")
def runner(tiny_family):
    return ModelRunner.from_pretrained(tiny_family.target_dir, max_model_len=128, kv_cache_rows=3 * 128)


@pytest.fixture(scope="module")
def recording(runner, tmp_path_factory):
    plain = Engine(runner, None, eos_token_id=None, max_batch=3)
    outputs = [
        c.token_ids for c in plain.generate(PROMPTS, RequestParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    ]
    path = tmp_path_factory.mktemp("replay") / "recording.json"
    path.write_text(json.dumps([p + o for p, o in zip(PROMPTS, outputs, strict=True)]))
    return path, outputs


@pytest.mark.parametrize("acceptance", [0.3, 0.8])
def test_replay_keeps_the_acceptance_it_is_told(runner, recording, acceptance):
    path, plain = recording
    k = 4
    config = {
        "method": "replay",
        "num_speculative_tokens": k,
        "acceptance": acceptance,
        "recording": str(path),
    }
    source = InProcessDraftSource(build_proposer(config, vocab_size=runner.model.vocab_size))
    engine = Engine(runner, source, eos_token_id=None, max_batch=3)
    outputs = [
        c.token_ids for c in engine.generate(PROMPTS, RequestParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    ]
    assert outputs == plain
    spec = engine.stats.spec
    expected = sum(acceptance**i for i in range(k + 1))
    # Drafts near the end are cut short by max_tokens, so tau sits a little under the ideal.
    assert expected - 0.6 < spec.mean_acceptance_length <= expected + 0.3, (
        spec.mean_acceptance_length,
        expected,
    )


def test_replay_needs_a_recording():
    with pytest.raises(ValueError, match="needs `recording`"):
        build_proposer({"method": "replay", "num_speculative_tokens": 2}, vocab_size=32)
