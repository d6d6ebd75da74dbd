"""One report format for every benchmark: `results/<name>.json` and `results/<name>.md`.

Each JSON report has `meta` (what ran, where, when, with which versions) and `results`, a list
of rows. Rows that describe decoding carry at least the fields of `DecodeRow`; other
benchmarks (micro-benchmarks) may use their own row fields. Speedups are always ratios
measured side by side in the same run: absolute tokens/s on these machines drift 15-25%
over minutes, ratios of interleaved runs do not.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

# In a checkout the reports land in benchmarks/results/ (where the committed ones live); from an
# installed wheel, in the working directory, never inside site-packages.
_CHECKOUT = Path(__file__).resolve().parents[2]
RESULTS_DIR = _CHECKOUT / "benchmarks" / "results" if (_CHECKOUT / "pyproject.toml").is_file() else Path.cwd()


@dataclass
class DecodeRow:
    method: str  # "plain" for no speculation; otherwise the registry name, e.g. "draft_model-tree"
    prompt_set: str  # "start" (file starts) or "mid" (mid-file code, the primary set)
    temperature: float
    tokens_per_s: float  # median over prompts
    speedup_vs_plain: float | None  # tokens_per_s / plain's, same run, same prompts
    acceptance_length: float | None  # tau: output tokens per target verify step; None without speculation
    extra: dict = field(default_factory=dict)  # method-specific figures (per-position acceptance, ...)

    def to_dict(self) -> dict:
        row = asdict(self)
        row.update(row.pop("extra"))
        return row


def environment() -> dict:
    import torch

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
    }


def _cell(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_cell(v) for v in value)
    return str(value)


def markdown_table(rows: list[dict], columns: list[str] | None = None) -> str:
    if not rows:
        return "_no rows_\n"
    columns = columns or list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_report(
    name: str,
    rows: list[dict],
    meta: dict,
    *,
    title: str,
    notes: str = "",
    columns: list[str] | None = None,
    results_dir: Path = RESULTS_DIR,
) -> tuple[Path, Path]:
    """Write `<name>.json` and `<name>.md`; return their paths."""
    results_dir.mkdir(parents=True, exist_ok=True)
    meta = {**environment(), **meta}
    json_path = results_dir / f"{name}.json"
    json_path.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    md = [f"# {title}", "", notes.strip(), "", markdown_table(rows, columns), "## Run", ""]
    md += [f"- {key}: {_cell(value)}" for key, value in meta.items()]
    md_path = results_dir / f"{name}.md"
    md_path.write_text("\n".join(line for line in md if line is not None) + "\n")
    return json_path, md_path


def add_run_arguments(parser, *, max_tokens: int, prompt_tokens: int) -> None:
    """The arguments every decoding benchmark takes: family, lengths, where the report goes."""
    parser.add_argument("--size", default="tiny", help="demo family (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--prompt-tokens", type=int, default=prompt_tokens)
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="default: benchmarks/results")


def write_run_report(name: str, rows: list[dict], args, *, title: str, notes: str) -> Path:
    """`write_report` for a benchmark run with `add_run_arguments`: `<name>_<size>`, the argv
    in `meta`, every row key a column; prints where it went."""
    import sys

    json_path, _ = write_report(
        f"{name}_{args.size}",
        rows,
        {"size": args.size, "argv": sys.argv[1:]},
        title=title,
        notes=notes,
        columns=list(dict.fromkeys(key for row in rows for key in row)),
        results_dir=args.results_dir,
    )
    print(f"wrote {json_path}")
    return json_path
