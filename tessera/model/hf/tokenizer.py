"""Tessera's byte-level tokenizer as a transformers tokenizer, written next to an exported checkpoint.

Tessera trains on bytes (:mod:`tessera.train.worker.data`: token id = byte value of the UTF-8
text, ids 0..255). :func:`byte_tokenizer` is that encoding as a transformers tokenizer (a
``tokenizers`` byte-level BPE with the 256 byte tokens and no merges, no special tokens), which
:func:`save_byte_tokenizer` writes next to an exported checkpoint (``tokenizer.json``,
``tokenizer_config.json``) so that ``AutoTokenizer.from_pretrained(PATH)`` encodes text as the
model was trained, offline. The same for every model family.
"""

from __future__ import annotations

import os

from tessera.errors import TesseraConfigError
from tessera.spec.model import ModelSpec

BYTE_VOCAB = 256
"""Token ids of Tessera's byte-level data (:data:`tessera.train.worker.data.VOCAB`): one per byte value."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""What :func:`save_byte_tokenizer` writes."""


def byte_tokenizer(model_max_length: int):
    """The transformers tokenizer of Tessera's training data: ``text`` -> its UTF-8 bytes, each byte
    one token whose id is the byte value (``tokenizer(text)["input_ids"] == list(text.encode())``);
    ``decode`` joins the bytes back into text (invalid UTF-8 becomes U+FFFD). A ``tokenizers``
    byte-level BPE: the GPT-2 byte-to-character table as its 256-token vocabulary (token ``b``
    is the character standing for byte ``b``), no merges, no regex split, no prefix space, no
    special tokens. ``model_max_length``: tokens the model's positions cover (``max_positions``).

    Returns:
        a ``transformers.PreTrainedTokenizerFast``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    char = bytes_to_unicode()  # byte value -> the printable character ByteLevel maps it to
    tok = Tokenizer(models.BPE(vocab={char[b]: b for b in range(BYTE_VOCAB)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=model_max_length,
                                   clean_up_tokenization_spaces=False)


def save_byte_tokenizer(to: str, model: ModelSpec) -> list[str]:
    """Write :func:`byte_tokenizer` (``model_max_length = model.max_positions``) into the HF
    directory ``to``; returns the file names (:data:`TOKENIZER_FILES`).

    Raises:
        TesseraConfigError: ``model.vocab`` is under :data:`BYTE_VOCAB` (byte ids would not fit).
    """
    if model.vocab < BYTE_VOCAB:
        raise TesseraConfigError("model.vocab", model.vocab, f"must be >= {BYTE_VOCAB} for the byte-level tokenizer "
                                 f"Tessera trains with (ids 0..{BYTE_VOCAB - 1})",
                                 "export a model with a vocabulary of at least 256")
    byte_tokenizer(model.max_positions).save_pretrained(to)
    return sorted(n for n in os.listdir(to) if n in TOKENIZER_FILES)
