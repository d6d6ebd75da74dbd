"""The demo tokenizer: byte-level BPE learned from the stdlib corpus.

Saved as a `tokenizer.json` plus the small config files that let
`transformers.AutoTokenizer.from_pretrained(dir)` load it as a fast tokenizer. Byte-level
means every string round-trips exactly, whatever characters it holds.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from outrider.demo.corpus import EOS_TOKEN, SourceFile
from outrider.demo.recipe import TokenizerRecipe


def train_tokenizer(files: list[SourceFile], recipe: TokenizerRecipe) -> Tokenizer:
    texts = [f.text for f in files]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "eos_token": EOS_TOKEN,
        "bos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"eos_token": EOS_TOKEN, "bos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def encode_files(tokenizer: Tokenizer, files: list[SourceFile]) -> np.ndarray:
    """One stream of token ids: each file followed by the end-of-text token."""
    eos = tokenizer.token_to_id(EOS_TOKEN)
    encodings = tokenizer.encode_batch([f.text for f in files])
    pieces = []
    for enc in encodings:
        pieces.append(np.asarray(enc.ids, dtype=np.int32))
        pieces.append(np.asarray([eos], dtype=np.int32))
    return np.concatenate(pieces)
