"""Split names: the stored records that a split, or a slice of one, reads.

Shared by the catalogue (split sizes, ``split_range``) and the readers of
records and byte streams (``_reader``, ``_text``), which import nothing else of
each other for it.
"""

from __future__ import annotations

import dataclasses

import tensorflow_datasets as tfds


@dataclasses.dataclass(frozen=True)
class SplitRange:
  """The records that a split name reads: records ``[start, stop)`` of split ``base``."""
  base: str
  start: int
  stop: int

  @property
  def size(self) -> int:
    return self.stop - self.start


def resolve_split(name: str, builder: tfds.core.DatasetBuilder, split: str) -> SplitRange:
  """The records that ``split`` reads, checked.

  A split name is a split of the data set ("train") or one slice of it in
  TFDS's syntax: "train[:90%]", "train[90%:]", "train[100:200]", "train[:-50]".
  Percentages are rounded to the closest record as TFDS rounds them, so that
  "train[:90%]" and "train[90%:]" part the records with none shared or left
  out. Unions ("train+test") are not accepted: a byte stream is read as one run
  of records.

  Raises:
    ValueError: an unknown split, a malformed slice, a union, or an empty slice.
  """
  if "+" in split:
    raise ValueError(f"Dataset {name!r}: split {split!r} is a union; read one split or one "
                     "slice of it, such as 'train[:90%]'")
  base = split.split("[", 1)[0]
  splits = builder.info.splits
  if base not in splits:
    raise ValueError(f"Dataset {name!r} has no split {split!r}; splits: {', '.join(splits)}")
  try:
    (part,) = tfds.core.ReadInstruction.from_spec(split).to_absolute(splits)
  except (ValueError, AssertionError) as e:
    first_line = (str(e).strip().splitlines() or [""])[0]
    raise ValueError(f"Dataset {name!r}: split {split!r} is not a split or a slice of one such "
                     f"as 'train[:90%]' ({first_line})") from None
  total = splits[base].num_examples
  start = part.from_ or 0
  stop = total if part.to is None else part.to
  if stop <= start:
    raise ValueError(f"Dataset {name!r}: split {split!r} holds no records (records {start} to "
                     f"{stop} of {total})")
  return SplitRange(base, start, stop)


def stored_bytes(builder: tfds.core.DatasetBuilder, r: SplitRange) -> int:
  """Stored size of the records of ``r`` (TFDS records no size for a slice: the base
  split's, in proportion to the records read)."""
  info = builder.info.splits[r.base]
  return info.num_bytes * r.size // max(info.num_examples, 1)
