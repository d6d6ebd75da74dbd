"""The policy benchmark's runs (outrider/benchmarks/bench_policy.py): how requests are admitted.

In `waves` each `batch` requests start together and the next wait for the last of them (a
wave ends with its slowest request, the batch shrinking meanwhile); in `continuous` every
request is handed to one engine at once, which admits a new one as soon as a slot frees, as
a server keeps its batch full. The output is the same either way.
"""

from __future__ import annotations

import pytest

from outrider.benchmarks.bench_policy import run_lockstep, run_once, runs, specs
from outrider.target_worker.engine import Engine
from outrider.target_worker.runner import ModelRunner
from outrider.target_worker.sequence import RequestParams

PROMPTS = [[5, 9, 11, 40, 7, 8, 9, 10], [300, 301, 17, 17, 18], [1000, 12, 13, 14, 15, 16]] * 2


@pytest.fixture(scope="module")
def runner(tiny_family):
    return ModelRunner.from_pretrained(tiny_family.target_dir, max_model_len=96, kv_cache_rows=6 * 96)


def test_batch_1_is_measured_once_and_larger_batches_both_ways():
    assert runs([1, 16], ["waves", "continuous"]) == [(1, "waves"), (16, "waves"), (16, "continuous")]
    assert runs([4], ["continuous"]) == [(4, "continuous")]


@pytest.mark.parametrize("mode", ["plain", "K2"])
def test_continuous_admission_refills_the_batch_where_waves_wait(runner, tiny_family, monkeypatch, mode):
    groups, batches = [], []
    add_request, step = Engine.add_request, Engine.step

    def counted_add(self, prompt, params=None):
        if not groups or groups[-1][0] != self.round:  # requests added between two steps: one group
            groups.append([self.round, 0])
        groups[-1][1] += 1
        return add_request(self, prompt, params)

    def counted_step(self):
        batches.append(len([s for s in self.running if not s.prefilling]))
        return step(self)

    monkeypatch.setattr(Engine, "add_request", counted_add)
    monkeypatch.setattr(Engine, "step", counted_step)
    spec = specs("ngram", tiny_family, None)
    rows = {}
    for admission in ("waves", "continuous"):
        groups.clear()
        rows[admission] = run_once(runner, PROMPTS, spec, mode, 0.0, 24, {}, batch=2, admission=admission)
        assert rows[admission]["tokens_per_s"] > 0
        assert [n for _, n in groups] == ([2, 2, 2] if admission == "waves" else [6])
    assert max(batches) == 2  # never more than `batch` decoding at once
    with pytest.raises(ValueError, match="admission"):
        run_once(runner, PROMPTS, spec, mode, 0.0, 24, {}, batch=2, admission="all")


def test_lockstep_interleaves_the_modes_each_on_its_own_cache(runner, tiny_family, monkeypatch):
    """Every mode's engine steps beside the others (not one run after another), and each has
    a KV cache of its own: interleaved on one cache they would write each other's rows (here
    the same rows alike, so the outputs below cannot tell: the caches are compared). At
    T = 0 every mode's output is plain greedy decoding's, token for token."""
    steps, outputs, caches = [], {}, {}
    step = Engine.step

    def recorded_step(self):
        steps.append(id(self))
        caches[id(self)] = id(self.runner.cache)
        out = step(self)
        for o in out:
            outputs.setdefault(id(self), {}).setdefault(o.request_id, []).extend(o.new_token_ids)
        return out

    monkeypatch.setattr(Engine, "step", recorded_step)
    spec = specs("ngram", tiny_family, None)
    modes = ["plain", "K2", "adaptive"]
    rows = run_lockstep(runner, PROMPTS, spec, modes, 0.0, 24, {}, batch=2, admission="continuous")
    assert set(rows) == set(modes) and all(r["tokens_per_s"] > 0 for r in rows.values())
    engines = list(dict.fromkeys(steps))
    assert len(engines) == 3 and len(set(caches.values())) == 3 and id(runner.cache) not in caches.values()
    last = [max(i for i, e in enumerate(steps) if e == engine) for engine in engines]
    first = [steps.index(engine) for engine in engines]
    assert max(first) < min(last)  # all had started before any finished
    monkeypatch.setattr(Engine, "step", step)
    alone = Engine(runner, None, eos_token_id=None, max_batch=2)
    expected = [c.token_ids for c in alone.generate(PROMPTS, RequestParams(max_tokens=24, ignore_eos=True))]
    for engine in engines:
        assert [outputs[engine][i] for i in sorted(outputs[engine])] == expected


def test_full_batch_figures_leave_out_the_drain(runner, tiny_family):
    """`full_tokens` counts the steps that began with every slot taken (running or waiting),
    so a run's drain (its last requests, the batch below `batch`) is left out. Plain decoding
    ends the requests it admitted together in one round: 4 requests 2 at a time have no drain;
    3 at a time, the fourth runs alone after the first three, all of it drain."""
    spec = specs("ngram", tiny_family, None)
    for batch, full in ((2, 4 * 24), (3, 3 * 24)):
        row = run_once(runner, PROMPTS[:4], spec, "plain", 0.0, 24, {}, batch=batch, admission="continuous")
        assert row["full_tokens"] == full and row["full_tokens_per_s"] > 0
    # A batch larger than the run's requests never has every slot taken: no rate, not a zero
    row = run_once(runner, PROMPTS[:2], spec, "plain", 0.0, 8, {}, batch=4, admission="continuous")
    assert row["full_tokens"] == 0 and row["full_tokens_per_s"] is None
