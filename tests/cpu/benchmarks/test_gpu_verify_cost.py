"""The GPU script's whole path on the CPU: a small Llama shape, paged verify forwards at two
batch sizes and tree sizes, the transformers comparison, and its report."""

from __future__ import annotations

import json
import math

from outrider.benchmarks import gpu_verify_cost


def test_the_gpu_script_runs_its_path_on_cpu(tmp_path):
    args = ["--device", "cpu", "--shape", "test", "--layers", "1", "--context", "24", "--batches", "1,3"]
    args += ["--trees", "1,9", "--steps", "1", "--repeats", "1", "--results-dir", str(tmp_path)]
    gpu_verify_cost.main(args)
    rows = json.loads((tmp_path / "gpu_verify_cost.json").read_text())["results"]
    verify = {(r["batch_size"], r["tree_nodes"]): r for r in rows if r["method"] == "verify_forward"}
    assert set(verify) == {(1, 1), (1, 9), (3, 1), (3, 9)}
    assert all(r["ms"] > 0 for r in verify.values())
    assert verify[3, 1]["relative_to_decode"] == 1.0 and verify[3, 9]["relative_to_decode"] > 0
    assert verify[1, 1]["bandwidth_bound_share"] > 0 and verify[1, 9]["bandwidth_bound_share"] is None
    hf = [r for r in rows if r["method"] == "transformers_generate"]
    # ms per step = (generate with new tokens - prefill only) / steps: a difference of two timings,
    # noise at this size; the figure is for GPUs.
    assert [r["batch_size"] for r in hf] == [1, 3] and all(math.isfinite(r["ms"]) for r in hf)
