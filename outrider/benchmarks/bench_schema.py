"""The JSON schema of `outrider bench` reports (schema_version 1); benchmarks/README.md explains each field.

`outrider bench --schema` prints it. Stable: fields may be added, none renamed or removed
without bumping `schema_version`. Every number is finite (NaN and inf are not JSON, and the
report writer refuses them); null means "does not apply" (tau of plain decoding, token
identity at T = 1, a speedup against a peer that did not run).
"""

from __future__ import annotations

_NUM = {"type": "number"}
_NUM_OR_NULL = {"type": ["number", "null"]}
_RATE = {"type": ["number", "null"], "minimum": 0, "maximum": 1}

# Figures every decode row (Outrider method, peer, tree-sweep point) carries.
_DECODE = {
    "prompt_set": {"type": "string"},
    "temperature": {"type": "number", "minimum": 0},
    "tokens_per_s": {"type": "number", "exclusiveMinimum": 0},
    "speedup_vs_plain": {"type": "number", "exclusiveMinimum": 0},
    "speedup_paired": {"type": "number", "exclusiveMinimum": 0},
    "speedup_vs_hf_plain": _NUM_OR_NULL,
    "speedup_vs_hf_assisted": _NUM_OR_NULL,
    "speedup_vs_hf_assisted_k4": _NUM_OR_NULL,
    "acceptance_length": _NUM_OR_NULL,
    "tau_non_looping": _NUM_OR_NULL,
    "accept_per_pos": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}},
    "tokens_per_step": _NUM,
    "target_forwards_per_token": {"type": "number", "exclusiveMinimum": 0},
    "drafter_time_share": {"type": "number", "minimum": 0, "maximum": 1},
    "draft_ms_per_round": _NUM_OR_NULL,
    "looping_share": {"type": "number", "minimum": 0, "maximum": 1},
    "greedy_identical": _RATE,
    "runs": {"type": "integer", "minimum": 1},
    "config": {"type": ["object", "null"]},
}
_DECODE_REQUIRED = [
    "prompt_set",
    "temperature",
    "tokens_per_s",
    "speedup_vs_plain",
    "acceptance_length",
    "looping_share",
    "tau_non_looping",
    "accept_per_pos",
    "target_forwards_per_token",
    "drafter_time_share",
    "greedy_identical",
    "runs",
]
_RESULT = {
    "type": "object",
    "properties": {"method": {"type": "string"}, **_DECODE},
    "required": ["method", *_DECODE_REQUIRED],
}

SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "outrider bench report",
    "type": "object",
    "required": [
        "schema_version",
        "machine",
        "meta",
        "headline",
        "results",
        "peers",
        "skipped",
        "tree_sweep",
        "serving",
    ],
    "properties": {
        "schema_version": {"const": 1},
        "machine": {
            "type": "object",
            "required": ["date", "machine", "processor", "cpu_count", "torch", "torch_threads", "python"],
        },
        "meta": {
            "type": "object",
            "required": [
                "models",
                "prompt_sets",
                "temperatures",
                "prompts_per_set",
                "repeats",
                "max_tokens",
                "duration_s",
            ],
            "properties": {"duration_s": {"type": "number", "minimum": 0}},
        },
        "headline": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [
                    "prompt_set",
                    "temperature",
                    "best_method",
                    "speedup_vs_plain",
                    "speedup_vs_hf_assisted",
                ],
                "properties": {
                    "best_method": {"type": "string"},
                    "speedup_vs_plain": _NUM,
                    "speedup_vs_hf_plain": _NUM_OR_NULL,
                    "speedup_vs_hf_assisted": _NUM_OR_NULL,
                    "speedup_vs_hf_assisted_k4": _NUM_OR_NULL,
                },
            },
        },
        "results": {"type": "array", "minItems": 1, "items": _RESULT},
        "peers": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"enum": ["hf-plain", "hf-assisted", "hf-assisted-k4", "hf-prompt-lookup"]},
                    **_DECODE,
                },
                "required": ["name", *_DECODE_REQUIRED],
            },
        },
        "skipped": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["method", "reason"],
                "properties": {"method": {"type": "string"}, "reason": {"type": "string", "minLength": 1}},
            },
        },
        "tree_sweep": {
            "type": "array",
            "items": {**_RESULT, "required": [*_RESULT["required"], "tree_nodes"]},
        },
        "sampling_cost": {  # plain at T > 0 beside plain at T = 0 (`bench_drafting.sampling_cost`)
            "type": "array",
            "items": {
                "type": "object",
                "required": ["prompt_set", "temperature", "speedup_vs_greedy", "speedup_paired", "runs"],
                "properties": {
                    "temperature": {"type": "number", "exclusiveMinimum": 0},
                    "speedup_vs_greedy": {"type": "number", "exclusiveMinimum": 0},
                    "speedup_paired": {"type": "number", "exclusiveMinimum": 0},
                    "runs": {"type": "integer", "minimum": 1},
                },
            },
        },
        "serving": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [
                    "variant",
                    "concurrency",
                    "requests",
                    "throughput_tokens_per_s",
                    "speedup_vs_off",
                    "latency_p50_s",
                    "latency_p90_s",
                    "acceptance_length",
                ],
                "properties": {
                    "variant": {"enum": ["off", "colocated", "disaggregated"]},
                    "concurrency": {"type": "integer", "minimum": 1},
                    "requests": {"type": "integer", "minimum": 1},
                    "throughput_tokens_per_s": {"type": "number", "exclusiveMinimum": 0},
                    "speedup_vs_off": {"type": "number", "exclusiveMinimum": 0},
                    "latency_p50_s": {"type": "number", "exclusiveMinimum": 0},
                    "latency_p90_s": {"type": "number", "exclusiveMinimum": 0},
                    "acceptance_length": _NUM_OR_NULL,
                },
            },
        },
    },
}


def validate(report: dict) -> None:
    """Raise jsonschema.ValidationError when `report` does not match SCHEMA."""
    import jsonschema

    jsonschema.validate(report, SCHEMA)
