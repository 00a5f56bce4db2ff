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

import functools
import os

import numpy as np

_READ_BLOCK = 4096  # Records read at once when measuring a stream.
_CACHED_RECORDS = 64


def tokenize(text: bytes, seq_len: int) -> dict[str, np.ndarray]:
  """Byte tokens of ``text``, truncated or padded to ``seq_len``.

  Returns:
    {"tokens": int32 [T] (bytes, then 0), "mask": bool [T] (True on bytes)}.
  """
  data = np.frombuffer(text[:seq_len], np.uint8)
  tokens = np.zeros(seq_len, np.int32)
  tokens[:len(data)] = data
  return {"tokens": tokens, "mask": np.arange(seq_len) < len(data)}


def _record_lengths(source, separator: bytes) -> np.ndarray:
  """Bytes per record (separator included); checks that chunked streams are in order."""
  lengths = np.zeros(len(source), np.int64)
  for start in range(0, len(source), _READ_BLOCK):
    indices = list(range(start, min(start + _READ_BLOCK, len(source))))
    for i, record in zip(indices, source.__getitems__(indices)):
      if "chunk" in record and record["chunk"] != i:
        raise ValueError(f"stream record {i} holds chunk {record['chunk']}: stored out of order")
      lengths[i] = len(record["text"]) + len(separator)
  return lengths


def _cached_lengths(builder, split: str, source, separator: bytes) -> np.ndarray:
  """Record lengths, cached next to the prepared data (computed once: lm1b has 30M records)."""
  path = os.path.join(os.fspath(builder.data_path),
                      f"attn_symmetry-lengths-{split}-sep{len(separator)}.npy")
  if os.path.exists(path):
    return np.load(path)
  lengths = _record_lengths(source, separator)
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

  Window i is stream[i T : i T + T + 1], read from the one or few records under
  it. Implements grain's random-access source protocol (__len__, __getitem__).

  Args:
    builder: a prepared TFDS builder whose records have a "text" feature.
    split: the split to read.
    seq_len: T.
    separator: bytes appended to every record (b"\\n" between sentences).
  """

  def __init__(self, builder, split: str, *, seq_len: int, separator: bytes = b""):
    self._source = builder.as_data_source(split=split)
    self._seq_len = seq_len
    self._separator = separator
    lengths = _cached_lengths(builder, split, self._source, separator)
    self._ends = np.cumsum(lengths)
    self._starts = self._ends - lengths
    total = int(self._ends[-1]) if len(lengths) else 0
    self._len = max(0, (total - 1) // seq_len)

  def __len__(self) -> int:
    return self._len

  @functools.lru_cache(maxsize=_CACHED_RECORDS)
  def _record(self, index: int) -> bytes:
    """Record ``index`` with its separator; cached, since neighbouring windows share records."""
    return self._source[index]["text"] + self._separator

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    if not 0 <= index < self._len:
      raise IndexError(f"window {index} out of range [0, {self._len})")
    start = index * self._seq_len
    end = start + self._seq_len + 1
    first = int(np.searchsorted(self._ends, start, side="right"))
    last = int(np.searchsorted(self._starts, end, side="left"))  # One past the last record.
    data = b"".join(self._record(i) for i in range(first, last))
    offset = start - int(self._starts[first])
    window = np.frombuffer(data, np.uint8, count=self._seq_len + 1, offset=offset)
    return {"tokens": window.astype(np.int32)}

  def __repr__(self) -> str:
    return f"WindowSource({self._source!r}, seq_len={self._seq_len})"
