"""Batched reads of a split's examples, from memory when the split is small.

Decoding a TFDS record costs tens of microseconds of Python per example, more
than a small model's training step spends on it. A split whose stored size is
at most ``IN_MEMORY_BYTES`` (digits, MNIST, Fashion-MNIST, CIFAR, IMDB, AG
News, wiki_bytes, enwik8) is therefore decoded once per process into numpy
columns, and batches are gathered from those by fancy indexing; larger splits
(ImageNet, lm1b) are read from the array_record files batch by batch.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import numpy as np

IN_MEMORY_BYTES = 256 << 20
_CACHED_SPLITS = 8
_READ_BLOCK = 4096  # Records decoded at once when loading a split.

_cache: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
_cache_lock = threading.Lock()


def cached(key: Hashable, load: Callable[[], Any]) -> Any:
  """``load()``, computed once per process for ``key`` (the last few splits are kept).

  Not ``functools.lru_cache``: it keys on the arguments (``load`` is a new
  closure per reader) and may compute a value twice when threads ask for it
  at once, where this lock decodes each split once, in one thread.
  """
  with _cache_lock:
    if key in _cache:
      _cache.move_to_end(key)
      return _cache[key]
    value = _cache[key] = load()
    if len(_cache) > _CACHED_SPLITS:
      _cache.popitem(last=False)
    return value


def _stack(values: list) -> np.ndarray:
  """Equal-shape arrays or numbers stacked; bytes or arrays of several shapes in an object array."""
  first = values[0]
  if isinstance(first, np.ndarray):
    if len({v.shape for v in values}) == 1:
      return np.stack(values)
  elif not isinstance(first, bytes):
    return np.asarray(values)
  out = np.empty(len(values), dtype=object)
  for i, value in enumerate(values):
    out[i] = value
  return out


def _columns(records: list[Mapping[str, Any]]) -> dict[str, np.ndarray]:
  return {k: _stack([r[k] for r in records]) for k in records[0]} if records else {}


class Records:
  """The converted examples of one split, read by batches of indices as columns.

  Args:
    source: a TFDS data source (random access, ``__getitems__``).
    convert: TFDS record -> canonical example dict.
    key: identifies the split (data path, split) for the in-memory cache.
    in_memory: decode the whole split once and index it in memory.
  """

  def __init__(self, source, convert: Callable[[Mapping[str, Any]], dict[str, Any]],
               key: Hashable, in_memory: bool):
    self._source = source
    self._convert = convert
    self._memory = cached(key, self._load) if in_memory else None

  def _read(self, indices: list[int]) -> list[dict[str, Any]]:
    return [self._convert(r) for r in self._source.__getitems__(indices)]

  def _load(self) -> dict[str, np.ndarray]:
    records = []
    for start in range(0, len(self._source), _READ_BLOCK):
      records += self._read(list(range(start, min(start + _READ_BLOCK, len(self._source)))))
    return _columns(records)

  def __len__(self) -> int:
    return len(self._source)

  def fetch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    """Examples ``indices`` (int [b]) as columns: arrays [b, ...] or object arrays [b]."""
    if self._memory is not None:
      return {k: v[indices] for k, v in self._memory.items()}
    return _columns(self._read(np.asarray(indices).tolist()))
