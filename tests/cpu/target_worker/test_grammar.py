"""Structured output under speculation: the grammar mask at every tree node, on the tiny demo family.

The demo model is a toy trained on Python source, so the grammar does all the work: 50 of 50
sampled outputs must parse and validate, greedy output must be the same with drafting on
and off (the drafters know nothing of the grammar, so their drafts break it often and must
be rejected by verification), and a tree's rows must follow each node's own path.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

import outrider.draft_worker.draft_model  # noqa: F401 - registers `draft_model`
from outrider.draft_worker import build_proposer
from outrider.target_worker.draft_source import InProcessDraftSource
from outrider.target_worker.engine import Engine
from outrider.target_worker.grammar import GrammarBackend, plain_bounded_strings
from outrider.target_worker.logits_processors import grammar_allowed
from outrider.target_worker.runner import ModelRunner
from outrider.target_worker.sequence import GrammarSpec, RequestParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}
JSON_SCHEMA = GrammarSpec("json_schema", json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def runner(tiny_family):
    return ModelRunner.from_pretrained(tiny_family.target_dir, max_model_len=128, kv_cache_rows=128 * 56)


@pytest.fixture(scope="module")
def grammars(runner, tiny_family):
    return GrammarBackend(str(tiny_family.tokenizer_dir), runner.model.vocab_size, (0,))


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer.encode("# a person as JSON\nperson = ", add_special_tokens=False)


def engine(runner, grammars, method: str | None, draft_dir, max_batch: int = 8) -> Engine:
    source = None
    if method is not None:
        config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
        if method == "draft_model":
            config = {
                "method": "draft_model",
                "model": str(draft_dir),
                "num_speculative_tokens": 4,
                "tree_top_k": 2,
            }
        source = InProcessDraftSource(build_proposer(config, vocab_size=runner.model.vocab_size))
    return Engine(runner, source, eos_token_id=0, grammars=grammars, max_batch=max_batch)


def test_fifty_sampled_outputs_validate(runner, grammars, prompt, tokenizer, tiny_family):
    eng = engine(runner, grammars, "draft_model", tiny_family.draft_dir, max_batch=50)
    params = [RequestParams(max_tokens=100, temperature=1.0, seed=s, grammar=JSON_SCHEMA) for s in range(50)]
    outs = eng.generate([prompt] * 50, params)
    for out in outs:
        assert out.finish_reason == "stop" and out.stop_reason == 0
        jsonschema.validate(json.loads(tokenizer.decode(out.token_ids)), SCHEMA)
    assert eng.stats.spec.num_draft_tokens > 0
    assert len({tuple(o.token_ids) for o in outs}) > 25  # sampled, not one answer 50 times
    assert grammars.compiled == 1  # one compilation, cached for the other 49


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_output_equals_speculation_off(runner, grammars, prompt, tiny_family, method):
    specs = [
        JSON_SCHEMA,
        GrammarSpec("json_object", ""),
        GrammarSpec("regex", r"(def|class) [a-z_]{1,12}\(\):"),
        GrammarSpec("choice", json.dumps(["import os", "import sys", "print"])),
    ]
    params = [RequestParams(max_tokens=60, grammar=g, logprobs=2) for g in specs]
    plain = engine(runner, grammars, None, None).generate([prompt] * len(specs), params)
    spec_engine = engine(runner, grammars, method, tiny_family.draft_dir)
    spec = spec_engine.generate([prompt] * len(specs), params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec_engine.stats.spec.num_draft_tokens > 0
    assert all(o.finish_reason == "stop" for o in plain[2:])  # the regex and the choice complete


def test_tree_rows_follow_each_path_and_rejected_drafts(grammars, tokenizer):
    """choice grammar {"yes", "no"}: after a node whose path already spells a whole choice only
    EOS is allowed; a node whose token breaks the grammar gets its parent's row (never
    reached: its parent gives it probability 0); the matcher ends where it started."""
    vocab = grammars.vocab_size
    matcher = grammars.matcher(GrammarSpec("choice", json.dumps(["yes", "no"])))
    yes, no = (
        tokenizer.encode("yes", add_special_tokens=False),
        tokenizer.encode("no", add_special_tokens=False),
    )
    bad = tokenizer.encode("x", add_special_tokens=False)[0]
    tokens = [1, yes[0], no[0], bad, *yes[1:]]
    parents = [-1, 0, 0, 0] + ([1] + list(range(4, 4 + len(yes) - 2)) if len(yes) > 1 else [])
    allowed = grammar_allowed(matcher, tokens, parents, vocab)
    assert bool(allowed[0, yes[0]]) and bool(allowed[0, no[0]]) and not bool(allowed[0, bad])
    assert torch.equal(allowed[3], allowed[0])  # the refused draft: its parent's row
    whole_yes = len(tokens) - 1 if len(yes) > 1 else 1
    assert allowed[whole_yes].nonzero().flatten().tolist() == [0]  # complete: EOS only
    if len(no) == 1:
        assert allowed[2].nonzero().flatten().tolist() == [0]
    # Rolled back: the matcher still accepts either word from the start.
    assert torch.equal(grammar_allowed(matcher, tokens[:1], [-1], vocab)[0], allowed[0])


def test_bounded_strings_admit_no_control_character(grammars, tokenizer):
    """xgrammar 0.2.9 lets raw control characters into maxLength strings (invalid JSON: the tiny
    model sampled one in 1 of 160 outputs); `plain_bounded_strings` rewrites them as patterns."""
    control = [t for t in range(tokenizer.vocab_size) if any(ord(c) < 32 for c in tokenizer.decode([t]))]
    matcher = grammars.matcher(JSON_SCHEMA)
    for token in tokenizer.encode('{"name": "', add_special_tokens=False):
        assert matcher.accept_token(token)
    allowed = grammar_allowed(matcher, [0], [-1], grammars.vocab_size)[0]
    assert control and not allowed[control].any()
    assert allowed.sum() > 1000  # plain characters are still allowed
    source = json.loads(plain_bounded_strings(json.dumps(SCHEMA)))["properties"]["name"]
    assert source == {"type": "string", "pattern": "^[ !#-\\[\\]-\ud7ff\ue000-\U0010ffff]{0,8}$"}


def test_bounded_strings_admit_no_surrogate_nor_overlong_bytes(grammars, tokenizer):
    """xgrammar 0.2.9 takes the bytes of a UTF-16 surrogate (ED A0 80) or an overlong encoding
    (E0 80 80, F0 80 80 80) for one character; they decode to 3-4 U+FFFD, so sampled maxLength 8
    names came back 10 and 11 characters long."""
    prefix = tokenizer.encode('{"name": "', add_special_tokens=False)
    cases = (
        (b"\xed\xa0\x80", False),
        (b"\xe0\x80\x80", False),
        (b"\xe0\x9f\xbf", False),
        (b"\xf0\x80\x80\x80", False),
        (b"\xf0\x8f\xbf\xbf", False),
        (b"\xf4\x90\x80\x80", False),  # past U+10FFFF
        ("é😀".encode(), True),
        (b"\xed\x9f\xbf", True),
        ("\U0010ffff\x7f".encode(), True),
    )
    for text, accepted in cases:
        matcher = grammars.matcher(JSON_SCHEMA)
        assert all(matcher.accept_token(t) for t in prefix)
        assert matcher.accept_string(text) is accepted, text
