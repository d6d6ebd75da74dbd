"""The demo corpus, its fixed held-out split, and the tokenizer on held-out files."""

from __future__ import annotations

import pytest

from outrider.demo import corpus


@pytest.fixture(scope="module")
def files():
    return corpus.load_corpus()


def test_split_is_disjoint_fixed_and_about_five_percent(files):
    train, held = files
    train_paths, held_paths = {f.path for f in train}, {f.path for f in held}
    assert not train_paths & held_paths
    assert all(corpus.is_held_out(p) for p in held_paths)
    assert not any(corpus.is_held_out(p) for p in train_paths)
    assert 0.02 < len(held) / (len(train) + len(held)) < 0.09
    # The rule depends on the path alone: these two answers hold on every machine.
    assert corpus.is_held_out("asyncio/base_events.py") is (
        __import__("hashlib").sha256(b"asyncio/base_events.py").digest()[0] < corpus.HELD_OUT_BYTE_BELOW
    )


def test_corpus_is_python3_source_without_site_packages(files):
    train, held = files
    for f in train + held:
        assert f.path.endswith(".py")
        assert not f.path.startswith("site-packages/")
    paths = {f.path for f in train + held}
    # lib2to3's Python 2 grammar sample is test data, not Python 3: it must be left out.
    assert "lib2to3/tests/data/py2_test_grammar.py" not in paths


def test_every_kth_is_deterministic_subset(files):
    train, _ = files
    subset = corpus.every_kth(train, 0.1)
    assert subset == corpus.every_kth(train, 0.1)
    assert abs(len(subset) - len(train) / 10) <= 1
    with pytest.raises(ValueError, match="fraction"):
        corpus.every_kth(train, 0.0)


def test_tokenizer_round_trips_held_out_files(tiny_family, files):
    from transformers import AutoTokenizer

    _, held = files
    tokenizer = AutoTokenizer.from_pretrained(tiny_family.tokenizer_dir)
    assert len(tokenizer) == tiny_family.manifest["tokenizer"]["vocab_size"]
    texts = [f.text for f in held]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    for text, ids in zip(texts, encoded, strict=True):
        assert tokenizer.decode(ids) == text
    # Byte-level: characters never seen in training still round-trip.
    odd = "naïve — ∑ 🐍\t\r\n"
    assert tokenizer.decode(tokenizer(odd, add_special_tokens=False)["input_ids"]) == odd
