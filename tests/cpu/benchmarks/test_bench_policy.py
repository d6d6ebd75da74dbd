"""The policy benchmark's runs (outrider/benchmarks/bench_policy.py): how requests are admitted.

In `waves` each `batch` requests start together and the next wait for the last of them (a
wave ends with its slowest request, the batch shrinking meanwhile); in `continuous` every
request is handed to one engine at once, which admits a new one as soon as a slot frees, as
a server keeps its batch full. The output is the same either way.
"""

from __future__ import annotations

import pytest

from outrider.benchmarks.bench_policy import run_once, runs, specs
from outrider.target_worker.engine import Engine
from outrider.target_worker.runner import ModelRunner

PROMPTS = [[5, 9, 11, 40, 7, 8, 9, 10], [300, 301, 17, 17, 18], [1000, 12, 13, 14, 15, 16]] * 2


@pytest.fixture(scope="module")
def runner(tiny_family):
    return ModelRunner.from_pretrained(tiny_family.target_dir, max_model_len=96, kv_cache_rows=6 * 96)


def test_batch_1_is_measured_once_and_larger_batches_both_ways():
    assert runs([1, 16], ["waves", "continuous"]) == [(1, "waves"), (16, "waves"), (16, "continuous")]
    assert runs([4], ["continuous"]) == [(4, "continuous")]


@pytest.mark.parametrize("mode", ["plain", "K2"])
def test_continuous_admission_refills_the_batch_where_waves_wait(runner, tiny_family, monkeypatch, mode):
    calls, batches = [], []
    generate, step = Engine.generate, Engine.step

    def counted_generate(self, prompts, params):
        calls.append(len(prompts))
        return generate(self, prompts, params)

    def counted_step(self):
        batches.append(len([s for s in self.running if not s.prefilling]))
        return step(self)

    monkeypatch.setattr(Engine, "generate", counted_generate)
    monkeypatch.setattr(Engine, "step", counted_step)
    spec = specs("ngram", tiny_family, None)
    rows = {}
    for admission in ("waves", "continuous"):
        calls.clear()
        rows[admission] = run_once(runner, PROMPTS, spec, mode, 0.0, 24, {}, batch=2, admission=admission)
        assert rows[admission]["tokens_per_s"] > 0
        assert calls == ([2, 2, 2] if admission == "waves" else [6])
    assert max(batches) == 2  # never more than `batch` decoding at once
    with pytest.raises(ValueError, match="admission"):
        run_once(runner, PROMPTS, spec, mode, 0.0, 24, {}, batch=2, admission="all")
