"""Training and evaluation iterators: grain over TFDS array_record data sources.

Both iterators define one global stream of examples and give each process its
share of every global batch, so that the global batch at each step is the
same whatever the number of processes:

    local batch k of process p = global stream [(k P + p) b, (k P + p + 1) b),

with P processes and b = batch_size / P examples per process. Concatenating
the local batches of processes 0..P-1 gives global batch k.

* Training: the stream is the split shuffled with ``seed``, reshuffled every
  epoch, repeated forever. Augmentation draws from a generator keyed by
  (seed, stream position), so it is deterministic as well. A global batch may
  straddle two epochs; every epoch sees each example once.
* Evaluation: the split in stored order, padded at the end to a multiple of
  the global batch with copies of the last example, marked ``valid=False``;
  every example is seen exactly once.

Batches are dicts of numpy arrays (see ``attn_symmetry.data``); reading runs
in ``num_threads`` threads ahead of the consumer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grain
import numpy as np

from attn_symmetry.data import _catalog
from attn_symmetry.data import _images
from attn_symmetry.data import _text

Batch = dict[str, np.ndarray]
_DEFAULT_THREADS = 8
_DEFAULT_PREFETCH = 16


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
                ) -> tuple[grain.MapDataset, Callable[[Any, np.random.Generator | None], Batch]]:
  """The split's examples and the transform that makes them model inputs.

  Returns:
    (examples, transform): transform(example, rng) gives one example of a batch;
    rng is a generator for augmentation, or None.
  """
  e, builder = _catalog.open_builder(name, data_dir, download=download)
  _catalog.check_kind(name, e, seq_len=seq_len, image_size=image_size, augment=augment)
  _catalog.check_split(name, builder, split)
  seq_len = seq_len or _catalog.DEFAULT_SEQ_LEN
  if e.kind == "stream":
    windows = _text.WindowSource(builder, split, seq_len=seq_len, separator=e.separator)
    return grain.MapDataset.source(windows), lambda example, rng: example
  records = grain.MapDataset.source(builder.as_data_source(split=split)).map(e.convert)
  if e.kind == "text":
    def text_example(example, rng):
      del rng
      return {**_text.tokenize(example["text"], seq_len), "label": np.int32(example["label"])}
    return records, text_example
  height = builder.info.features["image"].shape[0]
  size = _catalog.image_shape(builder, image_size)[0] if height is None else None
  def image_example(example, rng):
    image = _images.preprocess(example["image"], size=size, rng=rng, flip=e.flip)
    return {"image": image, "label": np.int32(example["label"])}
  return records, image_example


def _local_batches(stream: grain.MapDataset, local_batch: int, process_index: int,
                   process_count: int, num_threads: int) -> Iterator[Batch]:
  batches = stream.batch(local_batch)[process_index::process_count]
  options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=_DEFAULT_PREFETCH)
  return iter(batches.to_iter_dataset(options))


def train_iterator(name: str, *, batch_size: int, seed: int, data_dir: str | None = None,
                   seq_len: int | None = None, augment: bool = False, split: str = "train",
                   process_index: int | None = None, process_count: int | None = None,
                   image_size: int | None = None, download: bool = False,
                   num_threads: int = _DEFAULT_THREADS) -> Iterator[Batch]:
  """Infinite iterator over shuffled training batches, this process's share.

  Args:
    name: one of ``DATASETS``.
    batch_size: global batch size B, split evenly over the processes.
    seed: shuffling and augmentation seed; the same seed gives the same batches.
    data_dir: where prepared data sets live (default: ``default_data_dir()``).
    seq_len: text tokens T per example (default ``DEFAULT_SEQ_LEN``).
    augment: random crop (+ flip where it keeps the label) for images.
    split: the split to read.
    process_index, process_count: this process and the number of processes
      (default: ``jax.process_index()``, ``jax.process_count()``).
    image_size: crop side for variable-size images (ImageNet, default 224).
    download: prepare a missing data set that needs a download.
    num_threads: reader threads.

  Returns:
    An iterator of dicts with leading axis B / process_count: images {"image"
    float32 [b,Hi,Wi,C] in [-1, 1], "label" int32 [b]}; text classification
    {"tokens" int32 [b,T], "mask" bool [b,T], "label" int32 [b]}; language
    modelling {"tokens" int32 [b,T+1]}.

  Raises:
    ValueError: unknown data set, split or option; batch larger than the split.
    FileNotFoundError: the data set is not prepared (the message says how).
  """
  process_index, process_count, local_batch = _processes(batch_size, process_index,
                                                         process_count)
  examples, transform = _open_split(name, split, data_dir=data_dir, seq_len=seq_len,
                                    image_size=image_size, augment=augment, download=download)
  if batch_size > len(examples):
    raise ValueError(f"batch_size {batch_size} is larger than split {split!r} of {name!r} "
                     f"({len(examples)} examples)")
  stream = examples.seed(seed).shuffle().repeat()
  if augment:
    stream = stream.random_map(transform)
  else:
    stream = stream.map(lambda example: transform(example, None))
  return _local_batches(stream, local_batch, process_index, process_count, num_threads)


def eval_iterator(name: str, *, batch_size: int, split: str = "test", data_dir: str | None = None,
                  seq_len: int | None = None, process_index: int | None = None,
                  process_count: int | None = None, image_size: int | None = None,
                  download: bool = False,
                  num_threads: int = _DEFAULT_THREADS) -> Iterator[Batch]:
  """One pass over a split in stored order, this process's share of each global batch.

  The split is padded to a multiple of ``batch_size`` with copies of its last
  example, so every batch has the same shape; ``batch["valid"]`` (bool [b]) is
  False on the padding. A batch larger than the split is all padding but one
  batch. Arguments and batch layout as in ``train_iterator``.
  """
  process_index, process_count, local_batch = _processes(batch_size, process_index,
                                                         process_count)
  examples, transform = _open_split(name, split, data_dir=data_dir, seq_len=seq_len,
                                    image_size=image_size, augment=False, download=download)
  num = len(examples)
  padded = -(-num // batch_size) * batch_size

  def example_at(i):
    return {**transform(examples[min(i, num - 1)], None), "valid": np.bool_(i < num)}

  stream = grain.MapDataset.range(padded).map(example_at)
  return _local_batches(stream, local_batch, process_index, process_count, num_threads)
