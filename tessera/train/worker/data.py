"""Training data: a byte-level token stream cut into fixed-length sequences, sharded over replicas.

Corpus (``train.data``):

* ``pydoc`` (default, embedded, no download): the help texts of ``pydoc_data.topics.topics``
  joined in sorted-key order with blank lines between them (about 466 KB);
* a path to a ``.txt`` file (its UTF-8 bytes) or a ``.jsonl`` file (the ``"text"`` field of every
  line, joined with blank lines), absolute or relative to the working directory.

Tokens are bytes (vocabulary 256, the tiny presets' ``vocab``). Sequence ``i`` is the window of
``seq_length + 1`` tokens starting at ``i * seq_length`` (inputs are its first ``seq_length``
tokens, labels the last ``seq_length``). The order is a seeded permutation of the sequences,
drawn afresh for every epoch (``seed + epoch``), so the stream is a pure function of
(corpus, seq_length, seed).

Sharding: the data **position** ``p`` counts sequences consumed by the whole job (all
replicas). Iteration ``k`` consumes the global positions ``[k*G, (k+1)*G)`` with
``G = dp * num_microbatches * micro_batch_size``; replica ``d`` takes the ``d``-th contiguous
block of ``num_microbatches * micro_batch_size`` of them. Within each iteration the replicas'
shards are disjoint, and over an epoch they cover every sequence exactly once. The position is
the only state: it goes into checkpoints and :meth:`DataShard.load_state_dict` restores it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache

import torch

from tessera.errors import TesseraConfigError

VOCAB = 256
EMBEDDED = "pydoc"


def _pydoc_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def _jsonl_text(path: str) -> str:
    parts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TesseraConfigError("train.data", path, f"line {n} is not JSON ({e.msg})",
                                         "write one JSON object per line with a \"text\" field") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise TesseraConfigError("train.data", path, f"line {n} has no string \"text\" field",
                                         "write one JSON object per line with a \"text\" field")
            parts.append(obj["text"])
    return "\n\n".join(parts)


@lru_cache(maxsize=4)
def load_corpus(source: str) -> bytes:
    """The corpus bytes of ``train.data`` (see the module docstring).

    Raises:
        TesseraConfigError: unknown source, missing file, unsupported suffix, bad JSONL line.
    """
    if source == EMBEDDED:
        return _pydoc_text().encode("utf-8")
    if not os.path.isfile(source):
        raise TesseraConfigError("train.data", source, "is neither 'pydoc' nor an existing file",
                                 "use train.data=pydoc or the path of a .txt or .jsonl file")
    if source.endswith(".txt"):
        with open(source, "rb") as f:
            return f.read()
    if source.endswith(".jsonl"):
        return _jsonl_text(source).encode("utf-8")
    raise TesseraConfigError("train.data", source, "has an unsupported suffix",
                             "give a .txt file (raw text) or a .jsonl file (one {\"text\": ...} per line)")


@dataclass(frozen=True, eq=False)
class TokenSequences:
    """The corpus as byte tokens cut into ``num_sequences`` windows of ``seq_length + 1`` tokens.

    Raises:
        TesseraConfigError: the corpus is shorter than one sequence.
    """

    tokens: torch.Tensor  # uint8 [n]
    seq_length: int

    def __post_init__(self) -> None:
        if self.num_sequences < 1:
            raise TesseraConfigError("train.data", f"{self.tokens.numel()} bytes",
                                     f"is shorter than one sequence of {self.seq_length + 1} tokens",
                                     "use a larger corpus or a smaller parallel.seq_length")

    @staticmethod
    def from_source(source: str, seq_length: int) -> "TokenSequences":
        data = load_corpus(source)
        return TokenSequences(torch.frombuffer(bytearray(data), dtype=torch.uint8), seq_length)

    @property
    def num_sequences(self) -> int:
        return max(0, (self.tokens.numel() - 1) // self.seq_length)

    def sequence(self, i: int) -> torch.Tensor:
        """Window ``i`` as int64 ``[seq_length + 1]``."""
        s = i * self.seq_length
        return self.tokens[s:s + self.seq_length + 1].to(torch.int64)


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
    """The :class:`DataShard` of ``replica`` for ``recipe`` (``train.data``, ``train.seed`` and
    the parallel batch shape)."""
    p = recipe.parallel
    seqs = TokenSequences.from_source(recipe.train.data, p.seq_length)
    return DataShard(seqs, ShardSpec(p.dp, p.num_microbatches, p.micro_batch_size, recipe.train.seed), replica, position)
