"""`bench_drafting.lockstep`: engines stepped in turn by time spent, and the ratios built on it."""

from __future__ import annotations

from dataclasses import dataclass

from outrider.benchmarks import bench_drafting
from outrider.benchmarks.bench_drafting import Cell, Run, lockstep, row_for, sampling_cost
from outrider.kernels import SpecDecodeCounters


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Out:
    request_id: int
    new_token_ids: list[int]


class FakeEngine:
    """Each step costs `cost` seconds of the fake clock and yields one token, `steps` in all."""

    def __init__(self, name: str, cost: float, steps: int, clock: Clock, order: list[str]):
        self.name, self.cost, self.left, self.clock, self.order = name, cost, 0, clock, order
        self.steps = steps

    def add_request(self, prompt, params) -> int:
        self.left = self.steps
        return 7

    def has_unfinished(self) -> bool:
        return self.left > 0

    def step(self) -> list[Out]:
        self.order.append(self.name)
        self.clock.now += self.cost
        self.left -= 1
        return [Out(7, [self.left]), Out(8, [99])]  # another request's tokens are not this one's


def test_lockstep_steps_whichever_engine_has_spent_least(monkeypatch):
    clock, order = Clock(), []
    monkeypatch.setattr(bench_drafting.time, "perf_counter", clock)
    fast = FakeEngine("fast", 1.0, 6, clock, order)
    slow = FakeEngine("slow", 3.0, 2, clock, order)
    (fast_tokens, fast_s), (slow_tokens, slow_s) = lockstep([fast, slow], [1, 2], None)
    # Ties go to the first engine: fast 0->1, slow 0->3, fast to 3, fast 3->4, slow 3->6, fast to 6.
    assert order == ["fast", "slow", "fast", "fast", "fast", "slow", "fast", "fast"]
    assert (fast_s, slow_s) == (6.0, 6.0)
    assert fast_tokens == [5, 4, 3, 2, 1, 0] and slow_tokens == [1, 0]
    # `first` = 1: ties go to the second engine: slow 0->3, fast to 3, slow 3->6, fast to 6.
    order.clear()
    lockstep([fast, slow], [1, 2], None, first=1)
    assert order == ["slow", "fast", "fast", "fast", "slow", "fast", "fast", "fast"]


def test_lockstep_plain_engines_give_what_generate_gives(tiny_family):
    from outrider.target_worker.engine import Engine
    from outrider.target_worker.kv_cache import KVCache
    from outrider.target_worker.runner import ModelRunner
    from outrider.target_worker.sequence import RequestParams

    runner = ModelRunner.from_pretrained(tiny_family.target_dir, max_model_len=64, kv_cache_rows=64)
    other = ModelRunner(runner.model, KVCache(runner.model.kv_spec(), 64, runner.device), 64)
    a, b = Engine(runner, None, eos_token_id=None), Engine(other, None, eos_token_id=None)
    prompt = [5, 9, 13, 2, 7]
    for params in (
        RequestParams(max_tokens=12, ignore_eos=True),
        RequestParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True),
    ):
        expected = a.generate([prompt], params)[0].token_ids
        (tokens_a, seconds_a), (tokens_b, seconds_b) = lockstep([a, b], prompt, params)
        assert tokens_a == tokens_b == expected and len(expected) == 12
        assert seconds_a > 0 and seconds_b > 0

    # One params per engine: the sampling cost's pairs (T = 1 beside T = 0).
    sampled = RequestParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    greedy = RequestParams(max_tokens=12, ignore_eos=True)
    (tokens_a, _), (tokens_b, _) = lockstep([a, b], prompt, [sampled, greedy])
    assert tokens_a == a.generate([prompt], sampled)[0].token_ids
    assert tokens_b == a.generate([prompt], greedy)[0].token_ids != tokens_a
    cost = sampling_cost(a, b, [prompt, prompt[::-1]], 1.0, repeats=2, max_tokens=12)
    assert cost["runs"] == 4 and cost["temperature"] == 1.0
    assert 0.2 < cost["speedup_vs_greedy"] < 5 and 0.2 < cost["speedup_paired"] < 5


def run(tokens_per_s: float, plain_tokens_per_s: float, lockstep: bool = True) -> Run:
    return Run(
        tokens_per_s=tokens_per_s,
        num_tokens=100,
        num_steps=99,
        spec=SpecDecodeCounters(),
        draft_s=0.0,
        draft_rounds=0,
        looping=False,
        prompt=0,
        repeat=0,
        plain_tokens_per_s=plain_tokens_per_s,
        lockstep=lockstep,
    )


def test_speedup_is_plain_time_beside_the_runs_over_their_time():
    # Two runs: 1 s beside plain's 2 s, and 4 s beside plain's 2 s: 4 s / 5 s, whatever the
    # medians of the separate plain runs say.
    cell = Cell([run(100.0, 50.0), run(25.0, 50.0)])
    plain = Cell([run(500.0, 500.0, lockstep=False)])
    row = row_for("x", "mid", 0.0, cell, plain)
    assert abs(row["speedup_vs_plain"] - 0.8) < 1e-12
    assert abs(row["speedup_paired"] - (2.0 + 0.5) / 2) < 1e-12
    # Without a partner: the ratio of medians, as before.
    unpaired = Cell([run(100.0, 50.0, lockstep=False), run(25.0, 50.0, lockstep=False)])
    assert abs(row_for("x", "mid", 0.0, unpaired, plain)["speedup_vs_plain"] - 62.5 / 500.0) < 1e-12


def test_bench_engines_meet_each_prompt_alike(tiny_family):
    """The partner runs every prompt once per method, back to back: with prefix caching it
    would skip the prefill that the method's engine pays (plain beside plain read ~0.98x)."""
    from outrider.benchmarks.bench_sweep import engine_runs
    from outrider.target_worker.runner import ModelRunner
    from outrider.target_worker.sequence import RequestParams

    runner = ModelRunner.from_pretrained(tiny_family.target_dir, max_model_len=96, kv_cache_rows=160)
    runs = engine_runs(runner, {"plain": None, "again": None}, runner.model.vocab_size, [])
    prompt = list(range(3, 67))  # four full blocks of 16
    params = RequestParams(temperature=0.0, seed=0, max_tokens=8, ignore_eos=True)
    (first, first_tokens), (second, second_tokens) = (runs[name](prompt, params) for name in runs)
    assert first.lockstep and second.lockstep and first_tokens == second_tokens
    for engine in (runs["plain"].partner, runs["plain"].engine, runs["again"].engine):
        assert engine.blocks.stats.hits == 0
