"""The reports of `bench_autoscale`: autoscaling (JSON, Markdown, a plot) and the soak.

autoscale_tiny.json / .md / .png   replicas of both pools over time, queue, tokens/s, TTFT,
                                   how long each scale-up took after the load step
soak_tiny.json / .md               requests sent / completed / failed, wrong at T = 0,
                                   p50 / p99 latency per minute, memory per process
"""

from __future__ import annotations

import json
from pathlib import Path

from outrider.benchmarks.loadgen import Phase, RequestRecord, percentile
from outrider.benchmarks.report import markdown_table


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def phase_rows(phases: list[Phase], starts: list[float], records: list[RequestRecord]) -> list[dict]:
    rows = []
    for index, (phase, start) in enumerate(zip(phases, starts, strict=True)):
        end = start + phase.seconds
        done = [r for r in records if start <= r.start + r.latency_s < end]
        ok = [r for r in done if r.ok]
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        rows.append(
            {
                "phase": index,
                "start_s": round(start, 1),
                "seconds": phase.seconds,
                "clients": phase.concurrency,
                "completed": len(ok),
                "failed": len(done) - len(ok),
                "wrong_t0": sum(r.wrong for r in ok),
                "tokens_per_s": round(sum(r.tokens for r in ok) / phase.seconds, 2),
                "ttft_p50_s": _round(percentile(ttfts, 0.5)),
                "ttft_p99_s": _round(percentile(ttfts, 0.99)),
                "latency_p50_s": _round(percentile([r.latency_s for r in ok], 0.5)),
            }
        )
    return rows


def scale_events(samples: list[dict], key: str) -> list[dict]:
    """(t, from, to) whenever the running replica count of `key` changed."""
    events, last = [], None
    for sample in samples:
        n = sample[key]
        if last is not None and n != last:
            events.append({"t": sample["t"], "from": last, "to": n})
        last = n
    return events


def scale_up_times(samples: list[dict], pool: str, load_start: float, load_end: float) -> dict:
    """After the load step (seconds after it): the first replica Serve started (the decision),
    the first one running (decision + model load), and the peak of running replicas."""
    key, starting = f"{pool}_replicas", f"{pool}_starting"
    during = [s for s in samples if load_start <= s["t"] <= load_end]
    if not during:
        return {"first_started_s": None, "first_added_s": None, "peak": None, "peak_reached_s": None}
    base = next((s[key] for s in reversed(samples) if s["t"] < load_start), during[0][key])
    decided = next((s["t"] for s in during if s[starting] > 0), None)
    first = next((s["t"] for s in during if s[key] > base), None)
    peak = max(s[key] for s in during)
    reached = next(s["t"] for s in during if s[key] == peak)
    return {
        "replicas_before": base,
        "first_started_s": _round(decided - load_start if decided is not None else None, 1),
        "first_added_s": _round(first - load_start if first is not None else None, 1),
        "peak": peak,
        "peak_reached_s": _round(reached - load_start, 1) if peak > base else None,
    }


def write_autoscale(out: Path, meta: dict, phases, starts, records, samples) -> list[Path]:
    load_start, load_end = starts[1], starts[1] + phases[1].seconds
    summary = {
        "requests": len(records),
        "completed": sum(r.ok for r in records),
        "failed": sum(not r.ok for r in records),
        "wrong_t0": sum(r.wrong for r in records),
        "run_s": round(sum(p.seconds for p in phases), 1),
        "target_scale_up": scale_up_times(samples, "target", load_start, load_end),
        "draft_scale_up": scale_up_times(samples, "draft", load_start, load_end),
        "target_events": scale_events(samples, "target_replicas"),
        "draft_events": scale_events(samples, "draft_replicas"),
    }
    rows = phase_rows(phases, starts, records)
    report = {
        "meta": meta,
        "summary": summary,
        "phases": rows,
        "samples": samples,
        "requests": [r.to_dict() for r in records],
    }
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "autoscale_tiny.json", out / "autoscale_tiny.md", out / "autoscale_tiny.png"]
    paths[0].write_text(json.dumps(report, indent=1) + "\n")
    plot_autoscale(samples, records, starts, phases, paths[2])
    lines = [
        "# Autoscaling both pools under load (tiny demo family, 5-node local Ray cluster)",
        "",
        f"Run: {summary['run_s']} s of load after {meta['setup_s']} s of setup (cluster, deploy, reference "
        f"answers), on {meta['machine']['cpu_count']} shared CPU cores, {meta['machine']['date']}. "
        "Produced by `python -m outrider.benchmarks.bench_autoscale`.",
        "",
        f"Requests: {summary['requests']} sent, {summary['completed']} completed, {summary['failed']} failed, "
        f"{summary['wrong_t0']} wrong at T = 0.",
        "",
        "## Scale-up after the load step",
        "",
        "Seconds after the load step: `first_started_s` when Serve started a new replica (the "
        "autoscaler's decision, after its look-back window and upscale delay), `first_added_s` when "
        "it was running (plus the model load on this busy machine), `peak_reached_s` when the most "
        "replicas ran.",
        "",
        markdown_table(
            [
                {"pool": "target", **summary["target_scale_up"]},
                {"pool": "draft", **summary["draft_scale_up"]},
            ]
        ),
        "",
        f"Replica changes (t in s from the start of the load): target {summary['target_events']}, "
        f"draft {summary['draft_events']}.",
        "",
        "## Per phase",
        "",
        markdown_table(rows),
        "",
        "![replicas over time](autoscale_tiny.png)",
        "",
    ]
    paths[1].write_text("\n".join(lines))
    return paths


def plot_autoscale(samples, records, starts, phases, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    axes[0].step(t, [s["target_replicas"] for s in samples], where="post", label="target replicas")
    axes[0].step(t, [s["draft_replicas"] for s in samples], where="post", label="draft replicas")
    axes[0].step(t, [s["target_starting"] for s in samples], where="post", ls="--", label="target starting")
    axes[0].step(t, [s["draft_starting"] for s in samples], where="post", ls="--", label="draft starting")
    axes[0].set_ylabel("replicas")
    axes[1].plot(t, [s["running"] for s in samples], label="running sequences")
    axes[1].plot(t, [s["waiting"] for s in samples], label="waiting requests")
    axes[1].plot(t, [s["draft_busy"] for s in samples], label="drafters' busy share (sum)")
    axes[1].set_ylabel("queue")
    end = max(t) if t else 0
    bins = [i * 5.0 for i in range(int(end // 5) + 2)]
    tokens = [0] * len(bins)
    for r in records:
        if r.ok:
            tokens[min(int((r.start + r.latency_s) // 5), len(bins) - 1)] += r.tokens
    axes[2].step(bins, [n / 5 for n in tokens], where="post", label="tokens/s (completed)")
    ttft = [(r.start, r.ttft_s) for r in records if r.ok and r.ttft_s is not None]
    axes[2].scatter([x for x, _ in ttft], [10 * y for _, y in ttft], s=4, color="gray", label="TTFT x10 (s)")
    axes[2].set_ylabel("tokens/s")
    axes[2].set_xlabel("seconds")
    for ax in axes:
        for start, phase in zip(starts, phases, strict=True):
            if phase.concurrency > 1:
                ax.axvspan(start, start + phase.seconds, color="orange", alpha=0.1)
        ax.legend(loc="upper right", fontsize=8)
    axes[0].set_title("Both pools autoscaling (shaded: the load step)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_soak(
    out: Path, meta: dict, minutes: float, records, samples, memory, kills, resumes=None
) -> list[Path]:
    per_minute = []
    for minute in range(int(minutes + 0.999)):
        rs = [r for r in records if minute * 60 <= r.start < (minute + 1) * 60]
        ok = [r.latency_s for r in rs if r.ok and r.kind != "disconnect"]
        per_minute.append(
            {
                "minute": minute,
                "sent": len(rs),
                "completed": sum(r.ok for r in rs),
                "failed": sum(not r.ok for r in rs),
                "wrong_t0": sum(r.wrong for r in rs),
                "p50_s": _round(percentile(ok, 0.5)),
                "p99_s": _round(percentile(ok, 0.99)),
            }
        )
    processes = []
    for name, points in sorted(memory.items()):
        first, last = points[0], points[-1]
        processes.append(
            {
                "process": name,
                "first_mb": round(first[1] / 2**20, 1),
                "last_mb": round(last[1] / 2**20, 1),
                "growth_mb": round((last[1] - first[1]) / 2**20, 1),
                "sampled_s": round(last[0] - first[0], 1),
            }
        )
    failed = [r for r in records if not r.ok]
    summary = {
        "minutes": minutes,
        "sent": len(records),
        "completed": sum(r.ok for r in records),
        "failed": len(failed),
        "wrong_t0": sum(r.wrong for r in records),
        "greedy_checked": sum(r.greedy and r.ok and r.kind != "disconnect" for r in records),
        "disconnects": sum(r.kind == "disconnect" for r in records),
        "kills": kills,
        "resumes": resumes,  # choices the ingress resumed on another target replica (/metrics)
        "errors": sorted({r.error for r in failed})[:20],
    }
    report = {
        "meta": meta,
        "summary": summary,
        "per_minute": per_minute,
        "memory": processes,
        "samples": samples,
    }
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "soak_tiny.json", out / "soak_tiny.md"]
    paths[0].write_text(json.dumps(report, indent=1) + "\n")
    lines = [
        f"# Soak: {minutes:g} minutes of mixed load with a replica killed every minute",
        "",
        "Mixed load: streamed and whole, greedy (checked against the uninterrupted answer) and sampled "
        "(T = 1, seeded), short and long prompts, and clients that hang up after their first chunk. "
        f"Run: {minutes:g} min on {meta['machine']['cpu_count']} shared CPU cores, {meta['machine']['date']}; "
        "`python -m outrider.benchmarks.bench_autoscale`.",
        "",
        f"Requests: **{summary['sent']} sent, {summary['completed']} completed, {summary['failed']} failed, "
        f"{summary['wrong_t0']} wrong at T = 0** (of {summary['greedy_checked']} greedy answers checked); "
        f"{summary['disconnects']} client hang-ups.",
        "",
        "Kills: " + (", ".join(f"{k['killed']} at {k['t']} s" for k in kills) or "none") + ".",
        "",
        f"Choices resumed on another target replica after theirs was killed: {resumes}.",
        "",
        "Errors: " + ("; ".join(summary["errors"]) or "none") + ".",
        "",
        "## Latency per minute (completed requests, by start minute)",
        "",
        markdown_table(per_minute),
        "",
        "## Memory per process (RSS, first and last sample)",
        "",
        markdown_table(processes),
        "",
    ]
    paths[1].write_text("\n".join(lines))
    return paths
