"""The speculation cache, server half: pre-draft round r+1 while the target verifies round r.

After round r's tree for a sequence is sent, the drafter is idle until the target's next
delta arrives. That delta is always `accepted path + one token` (the recovered or bonus
token at the end of the accepted path), so the drafter can guess it from its own tree:

    tree r:   root -> a -> b -> c           outcomes, scored by learned acceptance and q:
                                             accept a b c, bonus x   P(reach c) * q(x | abc)
                                             accept a, bonus y       P(reach a) (1 - acc(2)) q(y | a) / (1 - q(b | a))
    for the top `max_outcomes`: fork the sequence's state, extend it with the delta, draft
    -> cache[seq] = {delta: (tree r+1, extended state)}

P(reach node) multiplies, per depth, the acceptance rate the cache has seen at that depth
(learned from the real deltas, which show how far each tree was accepted; 0.7 before any)
and the node's share of its siblings' q. The draft's own q is a poor acceptance model (a
small draft is often right with q = 0.1), but it ranks tokens well.

A bonus token must differ from every child the tree already holds at the end node (a drafted
child that matched would have been accepted), so it comes from the end node's q row minus
its children; at a leaf, from the root q row of a tree drafted from the state extended by the
path alone. When the real delta arrives and equals a cached one (same budget and sampling, no
features, no reset), the cached tree answers at once, re-labelled with the update's round,
and the extended fork becomes the sequence's real state: it is exactly the state `propose`
would have built, so the tree is exactly the one `propose` would have drafted.

Speculation runs on the drafting thread only when no real update is pending, one sequence
at a time, and the server starts a job only when it expects it to end before the next real
round (`IdleWindow`); a real round that arrives anyway interrupts the guess at its next draft
step (`DraftHints.interrupted`). While fewer than `min_hit_rate` of the rounds speculated for
were answered by a pushed guess in time (the target says so: `SequenceUpdate.answered`), only
one round in `probe_every` (and fewer, the longer it lasts) is: with no idle time to finish
guesses, or with the target's lanes already hiding the round trip, guessing only delays real
rounds. The server also pushes each job's trees to the target (`SpeculativeTree`), so a hit
costs no round trip: the target holds the tree before it asks. A proposer that cannot fork
(`can_fork` False) or that needs target features (eagle3, medusa, mtp: the delta's features
exist only once the target has verified it) is never speculated for. Every fork the cache
discards (a miss, the other outcomes of a hit, a forgotten sequence, the outcome probes)
goes back through `release_state` (the proposer's `Speculative` protocol), so a proposer whose
forks hold memory frees it. When a batch retires a sequence and the proposer keeps
cross-sequence state in `retire` (suffix's shared trie; `retire_changes_shared_state`), every
cached entry is dropped: its tree was drafted before that state changed.

    acceptance.py    AcceptanceModel: how often a draft is accepted at each depth, from real deltas
    outcomes.py      Outcome and `rank_outcomes`: the likeliest (accepted path, bonus) pairs
    cache.py         SpecCache: jobs, entries, lookups, the hit-rate gate
    idle_window.py   IdleWindow: the drafter's usual idle time between real rounds
    speculator.py    Speculator: the draft server's use of all the above, and the pushed trees
"""

from outrider.draft_worker.speculation.acceptance import AcceptanceModel
from outrider.draft_worker.speculation.cache import (
    SpecCache,
    SpecCacheConfig,
    SpecStats,
    supports_speculation,
)
from outrider.draft_worker.speculation.idle_window import IdleWindow
from outrider.draft_worker.speculation.outcomes import Outcome, q_rows, rank_outcomes
from outrider.draft_worker.speculation.speculator import Speculator, speculative_response

__all__ = [
    "AcceptanceModel",
    "IdleWindow",
    "Outcome",
    "SpecCache",
    "SpecCacheConfig",
    "SpecStats",
    "Speculator",
    "q_rows",
    "rank_outcomes",
    "speculative_response",
    "supports_speculation",
]
