"""Byte-level text: tokens for classification, fixed windows for language modelling.

Tokens are the UTF-8 bytes of the text (vocabulary 256, as enwik8 is modelled),
so nothing is trained or downloaded. Text classification truncates to T tokens
and pads with 0, with a boolean mask marking the real tokens. Language modelling
reads a split as one byte stream (the records in their stored order, each
followed by a separator) and cuts it into windows of T + 1 bytes with stride T,
so that inputs = window[:-1] and targets = window[1:] predict every byte of the
stream after the first exactly once; the last, partial window is dropped.
"""

from __future__ import annotations

import os

import numpy as np

from attn_symmetry.data import _records
from attn_symmetry.data import _splits

_READ_BLOCK = 4096  # Records read at once when loading or measuring a stream.


def tokenize(texts: list[bytes], seq_len: int) -> dict[str, np.ndarray]:
  """Byte tokens of ``texts``, each truncated or padded to ``seq_len``.

  Returns:
    {"tokens": int32 [B, T] (bytes, then 0), "mask": bool [B, T] (True on bytes)}.
  """
  tokens = np.zeros((len(texts), seq_len), np.int32)
  lengths = np.zeros(len(texts), np.int64)
  for i, text in enumerate(texts):
    data = np.frombuffer(text[:seq_len], np.uint8)
    tokens[i, :len(data)] = data
    lengths[i] = len(data)
  return {"tokens": tokens, "mask": np.arange(seq_len) < lengths[:, None]}


def _read_texts(source, indices: list[int], separator: bytes, first: int = 0) -> list[bytes]:
  """The texts of records ``indices`` of ``source``, each with the separator; checks that
  chunks are in order (record i of a slice that starts at record ``first`` of its split
  holds chunk first + i)."""
  texts = []
  for i, record in zip(indices, source.__getitems__(indices)):
    if "chunk" in record and record["chunk"] != first + i:
      raise ValueError(f"stream record {first + i} holds chunk {record['chunk']}: stored out "
                       "of order")
    texts.append(record["text"] + separator)
  return texts


def _blocks(size: int):
  """Index lists covering range(size) in blocks of _READ_BLOCK."""
  return (list(range(start, min(start + _READ_BLOCK, size)))
          for start in range(0, size, _READ_BLOCK))


def _record_lengths(source, separator: bytes) -> np.ndarray:
  """Bytes per record, separator included."""
  return np.array([len(t) for block in _blocks(len(source))
                   for t in _read_texts(source, block, separator)], np.int64)


def _cached_lengths(builder, split: str, separator: bytes) -> np.ndarray:
  """Record lengths of a whole split, cached next to the prepared data (computed once: lm1b
  has 30M records)."""
  path = os.path.join(os.fspath(builder.data_path),
                      f"attn_symmetry-lengths-{split}-sep{len(separator)}.npy")
  if os.path.exists(path):
    return np.load(path)
  lengths = _record_lengths(builder.as_data_source(split=split), separator)
  try:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
      np.save(f, lengths)
    os.replace(tmp, path)  # Atomic: a reader never sees half a file.
  except OSError:  # A read-only data dir: keep the lengths in memory only.
    pass
  return lengths


class WindowSource:
  """Random access to the windows of T + 1 bytes of a split's byte stream.

  Window i is stream[i T : i T + T + 1]. A small split (``IN_MEMORY_BYTES``) is
  held in memory as one byte array; otherwise a window is read from the one or
  few records under it. Implements grain's random-access source protocol
  (__len__, __getitem__, and __getitems__ for a batch of windows). A slice of
  a split ("train[:90%]", ``_splits.resolve_split``) is the stream of its
  records: slices that share no record share no byte.

  Args:
    builder: a prepared TFDS builder whose records have a "text" feature.
    split: the split or slice to read.
    seq_len: T.
    separator: bytes appended to every record (b"\\n" between sentences).
  """

  def __init__(self, builder, split: str, *, seq_len: int, separator: bytes = b""):
    records = _splits.resolve_split(builder.name, builder, split)
    self._source = builder.as_data_source(split=split)
    self._first = records.start
    self._seq_len = seq_len
    self._separator = separator
    if _splits.stored_bytes(builder, records) <= _records.IN_MEMORY_BYTES:
      key = (os.fspath(builder.data_path), split, separator)
      self._stream = _records.cached(key, self._load_stream)
      total = len(self._stream)
    else:
      self._stream = None
      lengths = _cached_lengths(builder, records.base, separator)[records.start:records.stop]
      self._ends = np.cumsum(lengths)
      self._starts = self._ends - lengths
      total = int(self._ends[-1]) if len(lengths) else 0
    self._len = max(0, (total - 1) // seq_len)

  def _load_stream(self) -> np.ndarray:
    return np.frombuffer(b"".join(b"".join(_read_texts(self._source, block, self._separator,
                                                       self._first))
                                  for block in _blocks(len(self._source))), np.uint8)

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return {"tokens": self.__getitems__([index])[0]}

  def __getitems__(self, indices) -> np.ndarray:
    """Windows ``indices`` (int [b]) as int32 [b, T + 1]."""
    indices = np.asarray(indices, np.int64)
    if indices.size and not (0 <= indices.min() and indices.max() < self._len):
      raise IndexError(f"windows {indices} out of range [0, {self._len})")
    starts = indices * self._seq_len
    if self._stream is not None:
      return self._stream[starts[:, None] + np.arange(self._seq_len + 1)].astype(np.int32)
    first = np.searchsorted(self._ends, starts, side="right")
    last = np.searchsorted(self._starts, starts + self._seq_len + 1, side="left")  # Exclusive.
    needed = sorted({r for a, b in zip(first, last) for r in range(a, b)})
    texts = dict(zip(needed, _read_texts(self._source, needed, self._separator, self._first)))
    windows = np.zeros((len(indices), self._seq_len + 1), np.int32)
    for i, (start, a, b) in enumerate(zip(starts, first, last)):
      data = b"".join(texts[r] for r in range(a, b))
      windows[i] = np.frombuffer(data, np.uint8, count=self._seq_len + 1,
                                 offset=int(start - self._starts[a]))
    return windows

  def __repr__(self) -> str:
    return f"WindowSource({self._source!r}, seq_len={self._seq_len})"
