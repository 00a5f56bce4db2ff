"""Training and evaluation iterators: grain over TFDS array_record data sources.

Both iterators define one global stream of examples and give each process its
share of every global batch, so that the global batch at each step is the
same whatever the number of processes:

    local batch k of process p = global stream [(k P + p) b, (k P + p + 1) b),

with P processes and b = batch_size / P examples per process. Concatenating
the local batches of processes 0..P-1 gives global batch k.

* Training: the stream is the split shuffled with ``seed``, reshuffled every
  epoch (a numpy permutation drawn from (seed, epoch)), repeated forever. Augmentation draws from a random key per (seed,
  stream position), so it is deterministic as well, and the same whatever the
  number of processes. A global batch may straddle two epochs; every epoch sees
  each example once.
* Evaluation: the split in stored order, padded at the end to a multiple of
  the global batch with copies of the last example, marked ``valid=False``;
  every example is seen exactly once.

A process reads its batch of b examples at once (one batched array_record
read, vectorised preprocessing); batches are read in ``num_threads`` threads
ahead of the consumer. Batches are dicts of numpy arrays (see
``attn_symmetry.data``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator

import grain
import numpy as np
from absl import flags

from attn_symmetry.data import _catalog
from attn_symmetry.data import _images
from attn_symmetry.data import _records
from attn_symmetry.data import _splits
from attn_symmetry.data import _text

Batch = dict[str, np.ndarray]
_DEFAULT_THREADS = 4
_DEFAULT_PREFETCH = 16
_ENDLESS = 2**62  # Batches of a training stream: more than any run reads.


def _processes(batch_size: int, process_index: int | None,
               process_count: int | None) -> tuple[int, int, int]:
  """(process index, process count, local batch size), checked."""
  if process_index is None or process_count is None:
    import jax  # pylint: disable=import-outside-toplevel
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
  if batch_size < 1:
    raise ValueError(f"batch_size must be positive, got {batch_size}")
  if process_count < 1 or not 0 <= process_index < process_count:
    raise ValueError(f"process_index {process_index} is not in [0, process_count="
                     f"{process_count})")
  if batch_size % process_count:
    raise ValueError(f"Global batch_size {batch_size} is not divisible by process_count "
                     f"{process_count}")
  return process_index, process_count, batch_size // process_count


def _open_split(name: str, split: str, *, data_dir: str | None, seq_len: int | None,
                image_size: int | None, augment: bool, download: bool
                ) -> tuple[int, Callable[[np.ndarray, np.ndarray | None], Batch]]:
  """The split's size and the function that reads a batch of it.

  Returns:
    (size, read): read(indices int [b], keys uint64 [b] or None) gives the batch
    of examples ``indices``, augmented with the per-example random ``keys``
    (``_images.example_keys``) when they are given.
  """
  e, builder = _catalog.open_builder(name, data_dir, download=download)
  _catalog.check_kind(name, e, seq_len=seq_len, image_size=image_size, augment=augment)
  span = _splits.resolve_split(name, builder, split)
  seq_len = seq_len or _catalog.DEFAULT_SEQ_LEN
  if e.kind == "stream":
    windows = _text.WindowSource(builder, split, seq_len=seq_len, separator=e.separator)
    def read_windows(indices, keys):
      del keys
      return {"tokens": windows.__getitems__(indices)}
    return len(windows), read_windows
  records = _records.Records(
      builder.as_data_source(split=split), e.convert, key=(os.fspath(builder.data_path), split),
      in_memory=_splits.stored_bytes(builder, span) <= _records.IN_MEMORY_BYTES)
  if e.kind == "text":
    def read_text(indices, keys):
      del keys
      columns = records.fetch(indices)
      return {**_text.tokenize(list(columns["text"]), seq_len),
              "label": columns["label"].astype(np.int32)}
    return len(records), read_text
  height = builder.info.features["image"].shape[0]
  size = _catalog.image_shape(builder, image_size)[0] if height is None else None

  def read_images(indices, keys):
    columns = records.fetch(indices)
    images = _images.preprocess(columns["image"], size=size, keys=keys, flip=e.flip)
    return {"image": images, "label": columns["label"].astype(np.int32)}
  return len(records), read_images


@functools.lru_cache(maxsize=4)  # A batch may straddle two epochs; threads read ahead.
def _epoch_order(seed: int, epoch: int, size: int) -> np.ndarray:
  """The permutation of range(size) that epoch ``epoch`` reads, from (seed, epoch) alone."""
  order = np.random.default_rng([seed % 2**64, epoch]).permutation(size)
  return order.astype(np.int32) if size < 2**31 else order


def _local_batches(read_positions: Callable[[np.ndarray], Batch], num_batches: int,
                   local_batch: int, process_index: int, process_count: int, num_threads: int,
                   num_workers: int) -> Iterator[Batch]:
  """Local batch k reads stream positions [(k P + p) b, (k P + p + 1) b)."""
  def batch(k):
    start = (k * process_count + process_index) * local_batch
    return read_positions(np.arange(start, start + local_batch))
  batches = grain.MapDataset.range(num_batches).map(batch)
  options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=_DEFAULT_PREFETCH)
  batches = batches.to_iter_dataset(options)
  if num_workers:
    if not flags.FLAGS.is_parsed():  # grain's workers read its absl flags.
      flags.FLAGS.mark_as_parsed()
    batches = batches.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))
  return iter(batches)


def train_iterator(name: str, *, batch_size: int, seed: int, data_dir: str | None = None,
                   seq_len: int | None = None, augment: bool = False, split: str = "train",
                   process_index: int | None = None, process_count: int | None = None,
                   image_size: int | None = None, download: bool = False,
                   num_threads: int = _DEFAULT_THREADS, num_workers: int = 0
                   ) -> Iterator[Batch]:
  """Infinite iterator over shuffled training batches, this process's share.

  Args:
    name: one of ``DATASETS``.
    batch_size: global batch size B, split evenly over the processes.
    seed: shuffling and augmentation seed; the same seed gives the same batches.
    data_dir: where prepared data sets live (default: ``default_data_dir()``).
    seq_len: text tokens T per example (default ``DEFAULT_SEQ_LEN``).
    augment: random crop (+ flip where it keeps the label) for images.
    split: the split to read, or a slice of it such as "train[:90%]" (TFDS's
      syntax; percentages round to the closest record, so "train[:90%]" and
      "train[90%:]" share no example).
    process_index, process_count: this process and the number of processes
      (default: ``jax.process_index()``, ``jax.process_count()``).
    image_size: crop side for variable-size images (ImageNet, default 224).
    download: prepare a missing data set that needs a download.
    num_threads: reader threads (per worker).
    num_workers: reader processes (grain multiprocessing) on top of the
      threads; 0 reads in this process. Worth it on hosts with many cores.

  Returns:
    An iterator of dicts with leading axis B / process_count: images {"image"
    float32 [b,Hi,Wi,C] in [-1, 1], "label" int32 [b]}; text classification
    {"tokens" int32 [b,T], "mask" bool [b,T], "label" int32 [b]}; language
    modelling {"tokens" int32 [b,T+1]}.

  Raises:
    ValueError: unknown data set, split or option; a malformed or empty slice;
      batch larger than the split.
    FileNotFoundError: the data set is not prepared (the message says how).
  """
  process_index, process_count, local_batch = _processes(batch_size, process_index,
                                                         process_count)
  size, read = _open_split(name, split, data_dir=data_dir, seq_len=seq_len,
                           image_size=image_size, augment=augment, download=download)
  if batch_size > size:
    raise ValueError(f"batch_size {batch_size} is larger than split {split!r} of {name!r} "
                     f"({size} examples)")

  def read_positions(j):
    """Position j of the stream holds example order_e[j mod size], e = j // size."""
    epochs, offsets = np.divmod(j, size)
    indices = np.empty_like(j)
    for epoch in np.unique(epochs):
      here = epochs == epoch
      indices[here] = _epoch_order(seed, int(epoch), size)[offsets[here]]
    return read(indices, _images.example_keys(seed, j) if augment else None)
  return _local_batches(read_positions, _ENDLESS, local_batch, process_index, process_count,
                        num_threads, num_workers)


def eval_iterator(name: str, *, batch_size: int, split: str = "test", data_dir: str | None = None,
                  seq_len: int | None = None, process_index: int | None = None,
                  process_count: int | None = None, image_size: int | None = None,
                  download: bool = False,
                  num_threads: int = _DEFAULT_THREADS, num_workers: int = 0
                  ) -> Iterator[Batch]:
  """One pass over a split in stored order, this process's share of each global batch.

  The split is padded to a multiple of ``batch_size`` with copies of its last
  example, so every batch has the same shape; ``batch["valid"]`` (bool [b]) is
  False on the padding. A batch larger than the split is all padding but one
  batch. Arguments and batch layout as in ``train_iterator``.
  """
  process_index, process_count, local_batch = _processes(batch_size, process_index,
                                                         process_count)
  size, read = _open_split(name, split, data_dir=data_dir, seq_len=seq_len,
                           image_size=image_size, augment=False, download=download)

  def read_positions(j):
    return {**read(np.minimum(j, size - 1), None), "valid": j < size}
  return _local_batches(read_positions, -(-size // batch_size), local_batch, process_index,
                        process_count, num_threads, num_workers)
