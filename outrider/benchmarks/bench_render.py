"""`outrider bench` outputs: the JSON report, its Markdown twin and three PNG plots, side by side.

<stem>.json               the report (benchmarks.bench_schema.SCHEMA), validated before writing
<stem>.md                 headline, tables, plots, run settings
<stem>_methods.png        tau and speedup vs plain per method (primary set), peers beside them
<stem>_tree_size.png      speedup (and tau) vs tree budget for the best tree method
<stem>_serving.png        throughput and p50 latency vs concurrency, speculation off / on
"""

from __future__ import annotations

import json
from pathlib import Path

from outrider.benchmarks.report import _cell, markdown_table

METHOD_COLUMNS = [
    "method",
    "prompt_set",
    "temperature",
    "tokens_per_s",
    "speedup_vs_plain",
    "speedup_paired",
    "speedup_vs_hf_assisted",
    "speedup_vs_hf_assisted_k4",
    "acceptance_length",
    "tau_non_looping",
    "looping_share",
    "accept_per_pos",
    "target_forwards_per_token",
    "drafter_time_share",
    "greedy_identical",
]
PEER_COLUMNS = [
    "name",
    *METHOD_COLUMNS[1:5],
    "speedup_vs_hf_plain",
    "looping_share",
    "target_forwards_per_token",
    "drafter_time_share",
    "greedy_identical",
]
TREE_COLUMNS = [
    "method",
    "tree_nodes",
    "tokens_per_s",
    "speedup_vs_plain",
    "speedup_paired",
    "acceptance_length",
    "accept_per_pos",
    "target_forwards_per_token",
    "drafter_time_share",
]
SERVING_COLUMNS = [
    "variant",
    "concurrency",
    "requests",
    "throughput_tokens_per_s",
    "speedup_vs_off",
    "latency_p50_s",
    "latency_p90_s",
    "acceptance_length",
]


def write_outputs(report: dict, json_path: Path) -> list[Path]:
    from outrider.benchmarks.bench_schema import validate

    validate(report)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    stem = json_path.with_suffix("")
    plots = plot(report, stem)
    md_path = stem.with_suffix(".md")
    md_path.write_text(markdown(report, [p.name for p in plots]))
    return [json_path, md_path, *plots]


def markdown(report: dict, plots: list[str]) -> str:
    meta, machine = report["meta"], report["machine"]
    out = [f"# `{meta['command']}`: {meta['models']}", ""]
    for line in report["headline"]:
        vs_assisted = line["speedup_vs_hf_assisted"]
        out.append(
            f"- **T = {line['temperature']:g}** (`{line['prompt_set']}` prompts): best method "
            f"`{line['best_method']}`, **{line['speedup_vs_plain']:.2f}x** plain decoding, "
            + (
                f"**{vs_assisted:.2f}x** `transformers` assisted generation"
                if vs_assisted
                else "no assisted peer"
            )
            + (
                f" ({line['speedup_vs_hf_assisted_k4']:.2f}x its tuned 4-token variant)"
                if line.get("speedup_vs_hf_assisted_k4")
                else ""
            )
            + (
                f", {line['speedup_vs_hf_plain']:.2f}x `transformers` plain"
                if line.get("speedup_vs_hf_plain")
                else ""
            )
            + "."
        )
    for cost in report.get("sampling_cost", []):
        out.append(
            f"- Plain decoding at T = {cost['temperature']:g} (`{cost['prompt_set']}`) runs at "
            f"**{cost['speedup_vs_greedy']:.3f}x** plain decoding at T = 0, each run beside a T = 0 "
            f"partner (median of per-run ratios {cost['speedup_paired']:.3f}, {cost['runs']} runs)."
        )
    out += [
        "",
        f"Batch 1, {meta['prompts_per_set']} held-out prompts per set x {meta['repeats']} repeats, "
        f"{meta['prompt_tokens']}-token prompts, {meta['max_tokens']} new tokens (EOS ignored), "
        f"{meta['threads']} torch thread(s), one process; in-process drafting (drafter time is on "
        f"the critical path). Per prompt, every configuration (methods and `transformers` peers) "
        f"runs once in a freshly shuffled order, and the sweep repeats. Each engine run goes step "
        f"by step beside a plain partner engine (same weights, its own KV cache), the next step "
        f"always the one of whichever has spent less time: this machine's speed drifts ~16% from "
        f"step to step (lag-1 autocorrelation 0.72, gone by ~100 steps), which runs one after "
        f"the other would see ~10% apart. `speedup_vs_plain` is the partner's time over the "
        f"method's, pooled over the cell's runs; `speedup_paired` the median of per-run ratios "
        f"(on the plain row, plain beside plain: the measurement's own bias). `tokens_per_s` is "
        f"the median over prompts, to read beside the peers (run alone, against plain's own "
        f"runs): `speedup_vs_hf_assisted` divides by `transformers` assisted generation's. "
        f"`{meta['primary_prompt_set']}` (mid-file code) is the primary set. Loops inflate "
        f"acceptance: `looping_share` is the share of outputs with > 50% repeated 4-grams and "
        f"`tau_non_looping` is tau over the others. Counts noise cannot move: "
        f"`target_forwards_per_token`, and at T = 0 `greedy_identical`, the share of outputs "
        f"token-identical to plain greedy decoding. Full run: {meta['duration_s'] / 60:.1f} minutes "
        f"({', '.join(f'{k} {v:.0f}' for k, v in meta['phases_s'].items())})."
        + (
            " The full preset's prompt counts, repeats and lengths took 20-36 minutes "
            "of wall time on the 2-core machines measured (shared with other work); more prompts narrow the spread."
            if meta.get("preset") == "full"
            else ""
        ),
        "",
        *[f"- {line}" for line in caveats(report)],
        "",
        "## Methods",
        "",
        markdown_table(report["results"], METHOD_COLUMNS),
        "## Peers: `transformers` generate()",
        "",
        markdown_table(report["peers"], PEER_COLUMNS),
        "Peer settings: "
        + "; ".join(f"`{p['name']}` {json.dumps(p['config'])}" for p in _first(report["peers"], "name")),
        "",
        "## Skipped methods",
        "",
        markdown_table(report["skipped"], ["method", "reason"])
        if report["skipped"]
        else "None: every registered method ran.\n",
        f"Registered methods (`draft_worker.known_methods()`): {', '.join(meta['known_methods'])}.",
        "",
        f"## Tree size (`{meta.get('tree_sweep_method')}`, `{meta['primary_prompt_set']}`, T = 0)",
        "",
        markdown_table(report["tree_sweep"], TREE_COLUMNS),
        f"## Serving: Ray Serve app over HTTP (`{meta.get('serving_method')}`)",
        "",
        "OpenAI `/v1/completions`, greedy, the primary set's prompts; `off` = no_speculation, `colocated` = "
        "the drafter in the target replica, `disaggregated` = a draft deployment over gRPC. Replicas reserve "
        "no CPUs and use one torch thread; speedups are against `off` at the same concurrency, same repeat. "
        f"Speculative config: `{json.dumps(meta.get('serving_config'))}`.",
        "",
        markdown_table(report["serving"], SERVING_COLUMNS),
        "## Plots",
        "",
        *[f"![{name}]({name})" for name in plots],
        "",
        "## Configurations",
        "",
        *[f"- `{r['method']}`: `{json.dumps(r['config'])}`" for r in _first(report["results"], "method")],
        "",
        "## Run",
        "",
        *[
            f"- {k}: {_cell(v)}"
            for k, v in {**machine, **meta}.items()
            if k not in ("phases_s", "serving_config")
        ],
        "",
    ]
    return "\n".join(out)


def caveats(report: dict) -> list[str]:
    """What the numbers of this run do not say, read off the numbers themselves."""
    lines = []
    rows = {(r["method"], r["prompt_set"], r["temperature"]): r for r in report["results"]}
    peers = {(p["name"], p["prompt_set"], p["temperature"]): p for p in report["peers"]}
    for (method, prompt_set, temperature), row in rows.items():
        if method == "plain" and row["looping_share"] > 0.5:
            lines.append(
                f"At T = {temperature:g} on `{prompt_set}`, {row['looping_share']:.0%} of plain decoding's "
                "outputs loop (> 50% repeated 4-grams): that cell's tau and speedups are measured on "
                "loops, which inflate acceptance (prompt lookup's most of all)"
                + (
                    "; no output escaped a loop, so tau_non_looping is empty."
                    if row["looping_share"] == 1
                    else "."
                )
            )
    for (name, prompt_set, temperature), peer in peers.items():
        ours = rows.get(("draft_model-chain", prompt_set, temperature))
        if name.startswith("hf-assisted") and temperature > 0 and ours:
            lines.append(
                f"At T = {temperature:g} on `{prompt_set}`, with the same draft LM, `{name}` needs {peer['target_forwards_per_token']:.2f} target forwards per output token "
                f"and `draft_model-chain` {ours['target_forwards_per_token']:.2f} (first-position acceptance "
                f"{ours['accept_per_pos'][0] if ours['accept_per_pos'] else 0:.2f})."
            )
    return lines


def _first(rows: list[dict], key: str) -> list[dict]:
    seen, out = set(), []
    for row in rows:
        if row[key] not in seen:
            seen.add(row[key])
            out.append(row)
    return out


def plot(report: dict, stem: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    primary = report["meta"]["primary_prompt_set"]
    paths = []

    fig, (ax_tau, ax_speed) = plt.subplots(2, 1, figsize=(11, 7), sharex=False)
    temps = report["meta"]["temperatures"]
    rows = [r for r in report["results"] if r["prompt_set"] == primary]
    methods = list(dict.fromkeys(r["method"] for r in rows if r["method"] != "plain"))
    peers = list(dict.fromkeys(p["name"] for p in report["peers"]))
    width = 0.8 / max(len(temps), 1)
    for i, t in enumerate(temps):
        by = {r["method"]: r for r in rows if r["temperature"] == t}
        by |= {p["name"]: p for p in report["peers"] if p["prompt_set"] == primary and p["temperature"] == t}
        xs = [x + i * width for x in range(len(methods))]
        ax_tau.bar(
            xs,
            [(by[m]["acceptance_length"] or 0) if m in by else 0 for m in methods],
            width,
            label=f"T={t:g}",
        )
        names = methods + peers
        xs = [x + i * width for x in range(len(names))]
        ax_speed.bar(
            xs, [by[n]["speedup_vs_plain"] if n in by else 0 for n in names], width, label=f"T={t:g}"
        )
    ax_tau.set_xticks(
        [x + width * (len(temps) - 1) / 2 for x in range(len(methods))], methods, rotation=30, ha="right"
    )
    ax_tau.set_ylabel("acceptance length tau")
    names = methods + peers
    ax_speed.set_xticks(
        [x + width * (len(temps) - 1) / 2 for x in range(len(names))], names, rotation=30, ha="right"
    )
    ax_speed.axhline(1.0, color="grey", lw=0.8)
    ax_speed.set_ylabel("speedup vs plain (same run)")
    for ax in (ax_tau, ax_speed):
        ax.legend()
    ax_tau.set_title(
        f"{report['meta']['models']}: `{primary}` prompts, {report['meta']['max_tokens']} new tokens"
    )
    fig.tight_layout()
    paths.append(_save(fig, stem, "methods"))

    fig, ax = plt.subplots(figsize=(6, 4))
    tree = sorted((r for r in report["tree_sweep"] if "-tree" in r["method"]), key=lambda r: r["tree_nodes"])
    chain = [r for r in report["tree_sweep"] if r["method"].endswith("-chain")]
    if tree:
        nodes = [r["tree_nodes"] for r in tree]
        ax.plot(
            nodes, [r["speedup_vs_plain"] for r in tree], "o-", color="C0", label="speedup vs plain (tree)"
        )
        ax.plot(nodes, [r["acceptance_length"] or 0 for r in tree], "s--", color="C1", label="tau (tree)")
        for r in chain:
            ax.plot(
                [r["tree_nodes"]],
                [r["speedup_vs_plain"]],
                "D",
                color="C0",
                mfc="none",
                label="speedup (chain)",
            )
            ax.plot(
                [r["tree_nodes"]],
                [r["acceptance_length"] or 0],
                "D",
                color="C1",
                mfc="none",
                label="tau (chain)",
            )
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("nodes verified per round (chain = draft tokens + 1)")
    method = (report["meta"].get("tree_sweep_method") or "").split("-tree")[0]
    ax.set_title(f"tree budget: {method}, `{report['meta']['primary_prompt_set']}`, T=0")
    fig.tight_layout()
    paths.append(_save(fig, stem, "tree_size"))

    fig, (ax_tp, ax_lat) = plt.subplots(1, 2, figsize=(11, 4))
    for variant in dict.fromkeys(r["variant"] for r in report["serving"]):
        points = sorted((r["concurrency"], r) for r in report["serving"] if r["variant"] == variant)
        xs = [c for c, _ in points]
        ax_tp.plot(xs, [r["throughput_tokens_per_s"] for _, r in points], "o-", label=variant)
        ax_lat.plot(xs, [r["latency_p50_s"] for _, r in points], "o-", label=variant)
    ax_tp.set_xlabel("concurrent requests")
    ax_tp.set_ylabel("output tokens/s")
    ax_lat.set_xlabel("concurrent requests")
    ax_lat.set_ylabel("p50 request latency (s)")
    for ax in (ax_tp, ax_lat):
        if report["serving"]:
            ax.set_xscale("log", base=2)
            ax.legend()
    ax_tp.set_title(f"serving ({report['meta'].get('serving_method')})")
    fig.tight_layout()
    paths.append(_save(fig, stem, "serving"))
    plt.close("all")
    return paths


def _save(fig, stem: Path, suffix: str) -> Path:
    path = stem.with_name(f"{stem.name}_{suffix}.png")
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":  # re-render a report's Markdown and plots from its JSON
    import sys

    for arg in sys.argv[1:]:
        print(*write_outputs(json.loads(Path(arg).read_text()), Path(arg)), sep="\n")
