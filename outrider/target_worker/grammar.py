"""Structured output: grammars compiled by xgrammar, one matcher per constrained sequence.

    GrammarSpec (from the API) --compile, cached--> CompiledGrammar --> GrammarMatcher per sequence

The matcher follows the committed tokens (`Sequence.append` feeds it each one); the logits
processors (`logits_processors.grammar_allowed`) advance it along each tree node's path,
read the mask there and roll it back, so every node's p is the grammar-masked target and a
draft that breaks the grammar gets probability 0 at its parent: verification rejects it.

The stop tokens are the model's EOS ids: once the grammar is complete, they are the only
tokens allowed, and one of them ends the sequence. JSON is generated compact (xgrammar's
`any_whitespace=False`, vLLM's `disable_any_whitespace`): free whitespace lets a model pad
forever instead of closing the object.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import torch

from outrider.target_worker.sequence import GrammarSpec

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)


def check_grammar(spec: GrammarSpec) -> None:
    """ValueError saying what is wrong if `spec` does not parse; needs no tokenizer (the API's check)."""
    import xgrammar as xgr

    if spec.kind not in GRAMMAR_KINDS:
        raise ValueError(f"unknown grammar kind {spec.kind!r}; one of {GRAMMAR_KINDS}")
    try:
        if spec.kind == "json_schema":
            xgr.Grammar.from_json_schema(spec.source, any_whitespace=False)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.source)
        elif spec.kind == "choice":
            xgr.Grammar.from_ebnf(choice_ebnf(json.loads(spec.source)))
        elif spec.kind == "grammar":
            xgr.Grammar.from_ebnf(spec.source)
    except Exception as e:  # xgrammar raises RuntimeError, ValueError or its own errors
        raise ValueError(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__) from e


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices`."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("choice needs a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


# A bounded string's characters, as code point ranges (not a negated class): space to U+D7FF
# and U+E000 to U+10FFFF, leaving out control characters (JSON forbids them raw), the quote and
# the backslash (so no escape sequence either: a subset of the schema's strings, all valid
# JSON) and the UTF-16 surrogates. xgrammar 0.2.9 builds a negated class's bytes without
# UTF-8's limits: it took ED A0..BF xx (a surrogate) and the overlong E0 80..9F xx and
# F0 80..8F xx xx for one character each; they are not UTF-8, so the text decodes to 3-4 U+FFFD
# and a maxLength 8 name came back 10-11 characters long (the surrogate in CI, the overlong here:
# 1 of 50 sampled outputs each). Its ranges are built right.
_BOUNDED_CHARS = "[ !#-\\[\\]-\ud7ff\ue000-\U0010ffff]"


def plain_bounded_strings(schema_source: str) -> str:
    """The schema with each string bounded by minLength/maxLength (and no pattern or format)
    given the equivalent `pattern` over plain characters.

    xgrammar 0.2.9 builds length-bounded strings from a rule that admits raw control
    characters, which JSON forbids: a tiny model sampled `"name": ") =: 0)) if\x12"` under
    maxLength 12 and json.loads refused it (its unbounded strings, and pattern strings, are
    right). Upstream: mlc-ai/xgrammar issues 286 and 636. The pattern also leaves out the
    surrogates, which xgrammar counts as characters and no UTF-8 decoder does."""
    schema = json.loads(schema_source)

    def visit(node):
        if isinstance(node, list):
            return [visit(item) for item in node]
        if not isinstance(node, dict):
            return node
        node = {key: visit(value) for key, value in node.items()}
        kinds = node.get("type") if isinstance(node.get("type"), list) else [node.get("type")]
        bounded = "minLength" in node or "maxLength" in node
        if kinds == ["string"] and bounded and "pattern" not in node and "format" not in node:
            low, high = int(node.pop("minLength", 0)), node.pop("maxLength", None)
            node["pattern"] = f"^{_BOUNDED_CHARS}{{{low},{'' if high is None else int(high)}}}$"
        return node

    return json.dumps(visit(schema))


class GrammarBackend:
    """Compiles grammars for one tokenizer (cached) and makes matchers for sequences.

    The tokenizer's grammar tables are built on the first structured request, so a replica
    that never serves one never pays for them."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, stop_token_ids: tuple[int, ...]):
        self.tokenizer_dir, self.vocab_size, self.stop_token_ids = tokenizer_dir, vocab_size, stop_token_ids
        self._compiler = None
        self._cache: OrderedDict[GrammarSpec, object] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # cache misses, for tests

    @property
    def compiler(self):
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.stop_token_ids) or None
            )
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler

    def compile(self, spec: GrammarSpec):
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        if spec.kind == "json_schema":
            grammar = self.compiler.compile_json_schema(
                plain_bounded_strings(spec.source), any_whitespace=False
            )
        elif spec.kind == "json_object":
            grammar = self.compiler.compile_builtin_json_grammar()
        elif spec.kind == "regex":
            grammar = self.compiler.compile_regex(spec.source)
        elif spec.kind == "choice":
            grammar = self.compiler.compile_grammar(choice_ebnf(json.loads(spec.source)))
        elif spec.kind == "grammar":
            grammar = self.compiler.compile_grammar(spec.source)
        else:
            raise ValueError(f"unknown grammar kind {spec.kind!r}; one of {GRAMMAR_KINDS}")
        with self._lock:
            self.compiled += 1
            self._cache[spec] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, spec: GrammarSpec):
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(spec))


def allowed_tokens(matcher, vocab_size: int) -> torch.Tensor:
    """[vocab] bool: what the matcher allows next."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask[0, :, None] >> bits) & 1).bool().flatten()  # bit j of word w = token 32 w + j
    return allowed[:vocab_size]
