"""One draft server shared by two targets: per-target counters, and fairness under a burst.

Target "burst" sends many sequences at once through a drafter that takes 30 ms a batch;
target "steady" runs one sequence beside it. Every round of "steady" still gets its tree in
time (the drafting loop takes every stream's pending rounds into the next batch), outputs
stay the plain greedy ones, and the server counts trees per target label.
"""

from __future__ import annotations

import threading

from draft_client_testlib import (
    DelayedProposer,
    client,
    encode_prompts,
    generate,
    load_runner,
    start_server,
)

from outrider.draft_worker.server_cli import build_server_proposer
from outrider.target_worker.draft_client.config import DraftClientConfig

OPTIONS = {"num_speculative_tokens": 4}


def test_two_targets_share_one_draft_server_fairly(tiny_family):
    prompts = encode_prompts(tiny_family.tokenizer_dir)
    burst_prompts = prompts * 6  # 24 sequences at once
    runners = [load_runner(tiny_family.target_dir), load_runner(tiny_family.target_dir)]
    plain_burst, plain_steady = generate(runners[0], burst_prompts)[0], generate(runners[1], prompts[:1])[0]
    proposer = DelayedProposer(
        build_server_proposer("ngram", dict(OPTIONS), tiny_family.draft_dir, tiny_family.tokenizer_dir), 0.03
    )
    server = start_server(tiny_family, proposer=proposer)
    address = [f"127.0.0.1:{server.port}"]
    assert DraftClientConfig().target_label == ""
    burst = client(tiny_family, address, round_deadline_s=5.0, target_label="burst")
    steady = client(tiny_family, address, round_deadline_s=5.0, target_label="steady")
    results = {}
    try:
        assert burst.wait_ready(20) and steady.wait_ready(20)
        worker = threading.Thread(
            target=lambda: results.update(burst=generate(runners[0], burst_prompts, burst))
        )
        worker.start()
        results["steady"] = generate(runners[1], prompts[:1], steady)
        worker.join(120)
        (burst_out, burst_stats), (steady_out, steady_stats) = results["burst"], results["steady"]
        assert burst_out == plain_burst and steady_out == plain_steady
        # Not one round of the steady target went without its tree, burst or not.
        assert steady_stats.num_missing_trees == 0 and steady_stats.num_trees > 0
        counts = server.stats.trees_by_target
        assert set(counts) == {"burst", "steady"}
        assert counts["burst"] >= burst_stats.num_trees and counts["steady"] >= steady_stats.num_trees
        assert counts["burst"] > counts["steady"]
    finally:
        burst.close()
        steady.close()
        server.stop(grace_s=0.5)
