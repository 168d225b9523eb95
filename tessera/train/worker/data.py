"""Training data: a token stream cut into fixed-length sequences, sharded over replicas.

Corpus (``train.data``; :mod:`tessera.train.worker.corpus`): ``pydoc`` (default, embedded, no
download: the help texts of ``pydoc_data.topics.topics`` in sorted-key order, about 466 KB), or
``.txt`` / ``.jsonl`` / ``.parquet`` files: one path, a glob or a list; a ``.txt`` file is one
document, a JSONL line or Parquet row one document (its ``train.data_field``, default ``text``).

Tokens (``train.tokenizer``; :mod:`tessera.train.worker.tokenizer`):

* ``bytes`` (default): token id = byte value (vocabulary 256, the tiny presets' ``vocab``); the
  documents' UTF-8 bytes joined with blank lines (``b"\\n\\n"``), held in memory
  (:func:`load_corpus`);
* a local tokenizer (``tokenizer.json`` or a saved Hugging Face tokenizer directory): every
  document encoded on its own and joined with the tokenizer's EOS token, encoded once into a
  memory-mapped token file that every later reader maps (:func:`tessera.train.worker.corpus.open_token_file`).

Sequence ``i`` is the window of ``seq_length + 1`` tokens starting at ``i * seq_length`` (inputs
are its first ``seq_length`` tokens, labels the last ``seq_length``). The order is a seeded
permutation of the sequences, drawn afresh for every epoch (``seed + epoch``), so the stream is a
pure function of (corpus, tokenizer, seq_length, seed).

Sharding: the data **position** ``p`` counts sequences consumed by the whole job (all
replicas). Iteration ``k`` consumes the global positions ``[k*G, (k+1)*G)`` with
``G = dp * num_microbatches * micro_batch_size``; replica ``d`` takes the ``d``-th contiguous
block of ``num_microbatches * micro_batch_size`` of them. Within each iteration the replicas'
shards are disjoint, and over an epoch they cover every sequence exactly once. The position is
the only state: it goes into checkpoints and :meth:`DataShard.load_state_dict` restores it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from tessera.errors import TesseraConfigError
from tessera.train.worker.corpus import corpus_bytes, data_sources, open_token_file
from tessera.train.worker.tokenizer import BYTE_VOCAB, is_bytes

VOCAB = BYTE_VOCAB
"""Token ids of the byte-level data."""


@lru_cache(maxsize=4)
def _corpus(sources: tuple[str, ...], field: str) -> bytes:
    return corpus_bytes(sources, field)


def load_corpus(source, field: str = "text") -> bytes:
    """The byte-level corpus of ``train.data`` value ``source`` (a string or a list): the
    documents' UTF-8 bytes joined with blank lines, a ``.txt`` file's bytes as they are
    (:func:`tessera.train.worker.corpus.corpus_bytes`).

    Raises:
        TesseraConfigError: unknown source, missing file, unsupported suffix, a bad line or row,
            no text (:mod:`tessera.train.worker.corpus`).
    """
    return _corpus(data_sources(source), field)


@dataclass(frozen=True, eq=False)
class TokenSequences:
    """The corpus's tokens cut into ``num_sequences`` windows of ``seq_length + 1`` tokens.

    ``tokens``: a 1-D array of ids, a ``torch.uint8`` tensor (byte level) or a ``numpy`` array
    (the token cache's ``memmap``); ``unit`` names its tokens in messages.

    Raises:
        TesseraConfigError: the corpus is shorter than one sequence.
    """

    tokens: object  # torch.Tensor | np.ndarray, [n]
    seq_length: int
    unit: str = "bytes"

    def __post_init__(self) -> None:
        if self.num_sequences < 1:
            raise TesseraConfigError("train.data", f"{len(self.tokens)} {self.unit}",
                                     f"is shorter than one sequence of {self.seq_length + 1} tokens",
                                     "use a larger corpus or a smaller parallel.seq_length")

    @staticmethod
    def from_source(source, seq_length: int, field: str = "text") -> "TokenSequences":
        """Byte-level sequences of ``train.data`` value ``source`` (:func:`load_corpus`)."""
        data = load_corpus(source, field)
        return TokenSequences(torch.frombuffer(bytearray(data), dtype=torch.uint8), seq_length)

    @staticmethod
    def from_recipe(recipe) -> "TokenSequences":
        """The sequences ``recipe`` trains on: byte level for ``train.tokenizer=bytes``, else the
        token cache's ``memmap`` (built under its lock when missing or stale)."""
        tr, seq_length = recipe.train, recipe.parallel.seq_length
        if is_bytes(tr.tokenizer):
            return TokenSequences.from_source(tr.data, seq_length, tr.data_field)
        return TokenSequences(open_token_file(recipe).array(), seq_length, "tokens")

    @property
    def num_sequences(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_length)

    def sequence(self, i: int) -> torch.Tensor:
        """Window ``i`` as int64 ``[seq_length + 1]``."""
        s = i * self.seq_length
        window = self.tokens[s:s + self.seq_length + 1]
        if isinstance(window, torch.Tensor):
            return window.to(torch.int64)
        return torch.from_numpy(np.asarray(window, dtype=np.int64))


@dataclass(frozen=True)
class ShardSpec:
    """Batch shape and sharding of one job: ``dp`` replicas, each taking ``num_microbatches``
    microbatches of ``micro_batch_size`` sequences per iteration; ``seed`` orders the epochs."""

    dp: int
    num_microbatches: int
    micro_batch_size: int
    seed: int = 0

    @property
    def per_replica(self) -> int:
        return self.num_microbatches * self.micro_batch_size

    @property
    def global_batch(self) -> int:
        return self.dp * self.per_replica


class DataShard:
    """One replica's view of the sequence stream, with the data position as its only state.

    Args:
        sequences: the tokenised corpus.
        spec: batch shape and sharding.
        replica: this replica (0 .. dp-1).
        position: global sequence position to start at (a multiple of ``spec.global_batch``).
    """

    def __init__(self, sequences: TokenSequences, spec: ShardSpec, replica: int, position: int = 0) -> None:
        if not 0 <= replica < spec.dp:
            raise ValueError(f"replica {replica} is outside 0..{spec.dp - 1}")
        self.sequences, self.spec, self.replica = sequences, spec, replica
        self._perms: dict[int, torch.Tensor] = {}
        self.position = 0
        self.load_state_dict({"position": position})

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.spec.seed + epoch)
            self._perms = {epoch: torch.randperm(self.sequences.num_sequences, generator=g)}
        return self._perms[epoch]

    def sequence_index(self, position: int) -> int:
        """Sequence index at global position ``position`` (epoch-wise seeded permutation)."""
        n = self.sequences.num_sequences
        return int(self._perm(position // n)[position % n])

    def indices_at(self, position: int) -> list[int]:
        """Sequence indices this replica takes in the iteration starting at global ``position``."""
        first = position + self.replica * self.spec.per_replica
        return [self.sequence_index(p) for p in range(first, first + self.spec.per_replica)]

    def next_batch(self) -> torch.Tensor:
        """The next iteration's tokens, int64 ``[num_microbatches, micro_batch_size, seq_length + 1]``;
        advances the position by the global batch."""
        idx = self.indices_at(self.position)
        seqs = torch.stack([self.sequences.sequence(i) for i in idx])
        self.position += self.spec.global_batch
        return seqs.view(self.spec.num_microbatches, self.spec.micro_batch_size, -1)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        p = int(state["position"])
        if p < 0 or p % self.spec.global_batch:
            raise ValueError(f"data position {p} is not a multiple of the global batch {self.spec.global_batch}")
        self.position = p


def shard_for(recipe, replica: int, position: int = 0) -> DataShard:
    """The :class:`DataShard` of ``replica`` for ``recipe`` (``train.data``, ``train.tokenizer``,
    ``train.seed`` and the parallel batch shape; :meth:`TokenSequences.from_recipe`)."""
    p = recipe.parallel
    seqs = TokenSequences.from_recipe(recipe)
    return DataShard(seqs, ShardSpec(p.dp, p.num_microbatches, p.micro_batch_size, recipe.train.seed), replica, position)
