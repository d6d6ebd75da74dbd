"""The speculation policy's settings and its counters for /metrics (`spec_policy`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PolicyConfig:
    adaptive: bool = True  # False: every sequence drafts the ceiling (vLLM's fixed K)
    probe_every: int = 16  # rounds between depth-1 probes of the sequences not speculating
    max_probe_every: int = 256  # the spacing doubles up to this while speculation stays off
    min_probe_every: int = 4  # the spacing of probes that cost next to nothing (see `_probed`)
    prior_strength: float = 4.0  # pseudo-observations of the batch-wide estimate per depth
    sequence_decay: float = 0.8  # per-observation decay of a sequence's counts (recent text matters)
    global_decay: float = 0.995
    cost_decay: float = 0.98  # per-round decay of the cost fits' sums (conditions drift)
    resolve_every: int = 8  # rounds between full solves of the deepest budget and the ratio
    fit_every: int = 16  # rounds between refits of the cost fits (at a full solve)
    gain_refresh: int = 4  # rounds a sequence's expected tokens and nodes are reused
    max_resolve_every: int = 64  # the spacing doubles up to this while solves keep their answer
    # While off, probes may cost about this share of the time. Where nothing is found (T = 1)
    # they are pure loss: at 1%, with the quiet rounds' ~1% and the warm-up, adaptive heads ran
    # 0.96x plain at batch 1 (eagle3's probe catching up ~190 held tokens: ~12 ms, 8 rounds).
    probe_share: float = 0.005
    empty_probe_share: float = 0.02  # what probes the drafter had nothing for may cost (`_note_probes`)
    warmup_cycles: int = 2  # rounds 0 .. (ceiling + 1) * cycles - 1 cycle the depth 0 .. ceiling
    probe_find_decay: float = 0.95  # per-probe decay of what probes found (`_value_gap`)
    probe_chain: int = 32  # kept probes in a row that paid, before spacing them again
    goodput_decay: float = 0.98  # per-round decay of the measured goodput of drafting / off rounds
    goodput_min_rounds: float = 10.0  # decayed drafting rounds (bursty) before the check can veto
    off_min_rounds: float = 3.0  # and rounds without drafts (steady: plain decoding)
    goodput_margin: float = 0.03  # drafting must measure this much less than off to be vetoed
    shadow_depth: int = 2  # tokens of an off greedy sequence's shadow draft (`policy_shadow`)
    # A greedy probe drafts at least this deep: kept in a loop, 2 drafts commit 3 tokens, which
    # pay for the round and start a probe chain; 1 could not (`Probing._probe_depth`).
    greedy_probe_depth: int = 2
    # ... unless this many (decayed) probes that deep kept their drafts and lost (`_greedy_floor`).
    deep_probe_evidence: float = 2.0


@dataclass
class PolicyStats:
    """For /metrics: chosen depths, and predicted vs measured committed tokens."""

    depth_counts: list[int] = field(default_factory=list)  # [d] = sequence-rounds given depth d
    # Sum over the verified sequence-rounds the policy decided of tokens(k) predicted (not
    # over `quiet` rounds, nobody drafting, where it is 1 token a sequence, as measured).
    predicted_tokens: float = 0.0
    measured_tokens: int = 0  # and of the tokens they committed
    rounds_off: int = 0  # rounds in which no sequence drafted
    vetoed_rounds: int = 0  # rounds the solver wanted drafts that measured goodput turned off
    off_probes: int = 0  # rounds turned off to measure goodput without speculation
    shadow_drafts: int = 0  # shadow drafts scored in hindsight (`policy_shadow`)
    shadow_kept: int = 0  # and their tokens that would have been kept
