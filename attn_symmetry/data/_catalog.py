"""The data sets that can be asked for, where they live, and how to prepare them.

A data set is either one of our TFDS builders (``_builders.py``) or a data set of
the TFDS catalogue, read by its TFDS name from a data dir where it was prepared
in the array_record format. Offline builders are prepared on first use; a data
set that needs a download is prepared only when asked (``download=True``, or
the ``prepare`` command line), and otherwise fails at once with the command.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib.util
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import tensorflow_datasets as tfds

from attn_symmetry import registry
from attn_symmetry import tasks
from attn_symmetry.data import _builders
from attn_symmetry.data import _splits
from attn_symmetry.data import _text

DATA_DIR_ENV = "ATTN_SYMMETRY_DATA_DIR"
DEFAULT_SEQ_LEN = 256
DEFAULT_IMAGE_SIZE = 224  # Side of the square crop for data sets of variable image size.
KINDS = ("image", "text", "stream")
VOCAB_SIZE = 256  # Byte-level tokens, for language modelling and text classification.


def _image(record: Mapping[str, Any]) -> dict[str, Any]:
  return {"image": record["image"], "label": record["label"]}


def _text_fields(*fields: str) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
  """Joins text fields with a newline (AG News: title, then description)."""
  def convert(record):
    return {"text": b"\n".join(record[f] for f in fields), "label": record["label"]}
  return convert


@dataclasses.dataclass(frozen=True)
class Entry:
  """How one data set is stored and read.

  Attributes:
    kind: "image", "text" (text classification) or "stream" (language
      modelling on the byte stream of the records, in order): ``KINDS``.
    builder: a TFDS builder class (ours in ``_builders``, or one's own; it
      is prepared on first use unless it downloads, as ``DOWNLOAD_BUILDERS``),
      or a TFDS name.
    convert: record of the data source -> canonical example: {"image" uint8
      [Hi,Wi,C], "label"} or {"text" bytes, "label"}; for streams {"text" bytes}.
      None takes the record's "image" (or "text") and "label" as they are.
    flip: horizontal flips keep the label (natural images, clothes; not digits).
    separator: bytes put after each record of a stream (sentences of lm1b).
    manual: what a manual preparation needs (ImageNet), for the error message.
  """
  kind: str
  builder: type | str
  convert: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
  flip: bool = False
  separator: bytes = b""
  manual: str = ""

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"data set kind must be one of {KINDS}, got {self.kind!r}")
    if self.convert is None and self.kind != "stream":
      object.__setattr__(self, "convert", _image if self.kind == "image" else _text_fields("text"))

  @property
  def offline(self) -> bool:
    """Prepared on first use: a builder class that needs no download."""
    return (isinstance(self.builder, type)
            and self.builder.name not in _builders.DOWNLOAD_BUILDERS)

  @property
  def tfds_name(self) -> str:
    return self.builder if isinstance(self.builder, str) else self.builder.name


_IMAGENET_MANUAL = (" --manual_dir DIR (DIR holding ILSVRC2012_img_train.tar and "
                    "ILSVRC2012_img_val.tar from image-net.org)")

CATALOG: registry.Registry = registry.Registry({
    # Offline: real data that installed with a package (the ``attn_symmetry.data`` docstring).
    "digits": Entry("image", _builders.Digits, _image),
    "mnist5k": Entry("image", _builders.Mnist5k, _image),
    "fashion_mnist_deb": Entry("image", _builders.FashionMnistDeb, _image, flip=True),
    "wiki_bytes": Entry("stream", _builders.WikiBytes),
    "wiki_direction": Entry("text", _builders.WikiDirection, _text_fields("text")),
    "newsgroups_mini": Entry("text", _builders.NewsgroupsMini, _text_fields("text")),
    "fortune_languages": Entry("text", _builders.FortuneLanguages, _text_fields("text")),
    # The paper's data sets, TFDS names.
    "mnist": Entry("image", "mnist", _image),
    "cifar10": Entry("image", "cifar10", _image, flip=True),
    "cifar100": Entry("image", "cifar100", _image, flip=True),
    "imagenet2012": Entry("image", "imagenet2012", _image, flip=True, manual=_IMAGENET_MANUAL),
    "imdb_reviews": Entry("text", "imdb_reviews", _text_fields("text")),
    "ag_news_subset": Entry("text", "ag_news_subset", _text_fields("title", "description")),
    "lm1b": Entry("stream", "lm1b", separator=b"\n"),
    # The paper's data sets that TFDS lacks: builders of ours that download.
    "dbpedia": Entry("text", _builders.Dbpedia, _text_fields("text")),
    "enwik8": Entry("stream", _builders.Enwik8),
    "wikitext103": Entry("stream", _builders.Wikitext103),
})

# The data set names: a live view of ``CATALOG``, so a registered data set is listed too.
DATASETS = CATALOG.keys()


def register_dataset(name: str, e: Entry) -> None:
  """Adds data set ``name`` read as ``e`` says: ``dataset_info``, the iterators, ``prepare``
  and the experiment configs' ``dataset.name`` accept it from then on.

  Raises:
    ValueError: the name is taken.
  """
  if name in CATALOG:
    raise ValueError(f"data set {name!r} is already registered")
  CATALOG[name] = e


def default_data_dir() -> str:
  """``$ATTN_SYMMETRY_DATA_DIR``, else ``~/.cache/attn_symmetry/tensorflow_datasets``."""
  return os.environ.get(DATA_DIR_ENV) or os.path.join(
      os.path.expanduser("~"), ".cache", "attn_symmetry", "tensorflow_datasets")


def entry(name: str) -> Entry:
  if name not in CATALOG:
    raise ValueError(f"Unknown dataset {name!r}; known: {', '.join(DATASETS)}")
  return CATALOG[name]


def dataset_kind(name: str) -> str:
  """What data set ``name`` holds, known without preparing it: "image", "text" (labelled
  texts, for classification) or "stream" (a byte stream, for language modelling)."""
  return entry(name).kind


def resolve_data_dir(data_dir: str | None) -> str:
  """The data dir to use. An explicit one must exist; the default one is created."""
  if data_dir is None:
    data_dir = default_data_dir()
    os.makedirs(data_dir, exist_ok=True)
  elif not os.path.isdir(data_dir):
    raise ValueError(f"data_dir {data_dir!r} does not exist (create it, or pass data_dir=None "
                     f"for ${DATA_DIR_ENV} or the default {default_data_dir()!r})")
  return os.path.abspath(data_dir)


def prepare_command(name: str, data_dir: str) -> str:
  """The shell command that prepares ``name`` into ``data_dir``."""
  e = entry(name)
  command = f"python -m attn_symmetry.data.prepare {name} --data_dir {data_dir}{e.manual}"
  if isinstance(e.builder, str):  # TFDS builders encode images and text with TensorFlow.
    command = f"pip install -e '.[prepare]' && {command}"
  return command


def tensorflow_available() -> bool:
  return importlib.util.find_spec("tensorflow") is not None


class DatasetUnavailable(FileNotFoundError):
  """A data set that is not prepared and cannot be prepared here without a download, or
  without TensorFlow: one line that gives the command which prepares it."""


class _NoVariantWarnings(logging.Filter):
  """Drops TFDS's warning that a data set's version folder has no dataset_info.json, which it
  says when the folder does not exist at all (a data set not prepared yet: ``open_builder``'s
  error says so, with the command that prepares it)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return "has no dataset_info.json" not in record.getMessage()


logging.getLogger("absl").addFilter(_NoVariantWarnings())  # where TFDS logs it


def _make_builder(e: Entry, data_dir: str, **kwargs) -> tfds.core.DatasetBuilder:
  if isinstance(e.builder, str):
    return tfds.builder(e.builder, data_dir=data_dir, file_format="array_record", **kwargs)
  return e.builder(data_dir=data_dir, file_format="array_record", **kwargs)


@contextlib.contextmanager
def _lock(data_dir: str, name: str):
  """An exclusive lock per data set, so that processes prepare it once, one at a time."""
  with open(os.path.join(data_dir, f".{name}.lock"), "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def prepare_dataset(name: str, data_dir: str, *, manual_dir: str | None = None,
                    archive: str | None = None) -> tfds.core.DatasetBuilder:
  """Prepares ``name`` into ``data_dir`` (atomic: TFDS writes aside, then renames).

  Args:
    name: one of ``DATASETS``.
    data_dir: the data dir.
    manual_dir: files downloaded by hand (imagenet2012).
    archive: a local copy of what enwik8, wikitext103 or dbpedia would download.

  Returns:
    The prepared builder.

  Raises:
    FileNotFoundError: an offline data set's source files are missing (the
      message names the install command).
    DatasetUnavailable: a TFDS data set, without TensorFlow installed.
  """
  e = entry(name)
  if isinstance(e.builder, type):
    if hasattr(e.builder, "check_sources"):  # ours name the install step of missing sources
      e.builder.check_sources()
  elif not tensorflow_available():
    raise DatasetUnavailable(f"preparing TFDS dataset {name!r} needs TensorFlow, which is not "
                             f"installed, and a network (it downloads): "
                             f"{prepare_command(name, data_dir)}")
  kwargs = {"archive": archive} if archive and name in _builders.DOWNLOAD_BUILDERS else {}
  with _lock(data_dir, name):
    builder = _make_builder(e, data_dir, **kwargs)
    if not builder.is_prepared():
      config = tfds.download.DownloadConfig(manual_dir=manual_dir) if manual_dir else None
      builder.download_and_prepare(download_config=config)
  return builder


def open_builder(name: str, data_dir: str | None, *,
                 download: bool = False) -> tuple[Entry, tfds.core.DatasetBuilder]:
  """The prepared builder of ``name``, preparing offline data sets on first use.

  Raises:
    ValueError: unknown name, or an explicit data_dir that does not exist.
    DatasetUnavailable: a data set that needs a download is not prepared and
      ``download`` is False; the message gives the command that prepares it.
  """
  e = entry(name)
  data_dir = resolve_data_dir(data_dir)
  builder = _make_builder(e, data_dir)
  if not builder.is_prepared():
    if not (e.offline or download):
      raise DatasetUnavailable(
          f"dataset {name!r} is not prepared in {data_dir}; preparing it downloads it (it needs "
          f"a network): {prepare_command(name, data_dir)}")
    builder = prepare_dataset(name, data_dir)
  if builder.info.file_format != tfds.core.FileFormat.ARRAY_RECORD:
    raise FileNotFoundError(
        f"Dataset {name!r} in {builder.data_path} is in {builder.info.file_format.value} format; "
        f"reading needs array_record. Prepare it with: {prepare_command(name, data_dir)}")
  return e, builder


def split_range(name: str, split: str, *, data_dir: str | None = None,
                download: bool = False) -> _splits.SplitRange:
  """The records of the stored split that ``split`` reads (``_splits.resolve_split``): two
  split names of one data set share no example if their ranges do not meet.

  Args:
    name: one of ``DATASETS``.
    split: a split ("train") or a slice of one ("train[90%:]").
    data_dir, download: as for ``dataset_info``.
  """
  _, builder = open_builder(name, data_dir, download=download)
  return _splits.resolve_split(name, builder, split)


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  """What a model needs to know about a data set.

  Attributes:
    name: the name asked for.
    task: ``tasks.CLASSIFICATION`` (images, labelled texts) or ``tasks.LM``
      (byte streams).
    input_key: the batch entry that holds a model's input: "image" or "tokens".
    byte_level: the tokens are bytes (vocabulary ``VOCAB_SIZE``), so a
      language model's loss converts to bits per byte; False for images.
    num_classes: number of labels (classification), else None.
    image_shape: (Hi, Wi, C) of the batches' images, else None.
    vocab_size: token vocabulary (text), else None.
    seq_len: tokens per example (text), else None; LM batches hold seq_len + 1.
    splits: number of examples per split, as the iterators count them (LM:
      windows of seq_len + 1 bytes): every split of the data set, and the
      slices asked for.
    description: the source, and what the labels mean.
    flip: whether ``augment`` flips images horizontally.
  """
  name: str
  task: str
  input_key: str
  byte_level: bool
  num_classes: int | None
  image_shape: tuple[int, int, int] | None
  vocab_size: int | None
  seq_len: int | None
  splits: dict[str, int]
  description: str
  flip: bool = False


def image_shape(builder: tfds.core.DatasetBuilder, image_size: int | None) -> tuple[int, int, int]:
  """The batch image shape: the stored one, or image_size square when it varies."""
  height, width, channels = builder.info.features["image"].shape
  if height is None or width is None:
    size = image_size or DEFAULT_IMAGE_SIZE
    return (size, size, channels)
  if image_size is not None:
    raise ValueError(f"image_size applies to data sets of variable image shape; this one has "
                     f"{(height, width, channels)}")
  return (height, width, channels)


def check_kind(name: str, e: Entry, *, seq_len: int | None, image_size: int | None,
               augment: bool = False) -> None:
  """Rejects options that do not apply to this kind of data set."""
  if e.kind == "image" and seq_len is not None:
    raise ValueError(f"seq_len applies to text data sets; {name!r} holds images")
  if e.kind != "image" and (image_size is not None or augment):
    raise ValueError(f"image_size and augment apply to image data sets; {name!r} holds text")
  if seq_len is not None and seq_len < 1:
    raise ValueError(f"seq_len must be positive, got {seq_len}")


def dataset_info(name: str, *, data_dir: str | None = None, seq_len: int | None = None,
                 image_size: int | None = None, download: bool = False,
                 slices: Sequence[str] = ()) -> DatasetInfo:
  """Describes a data set (preparing an offline one on first use).

  Args:
    name: one of ``DATASETS``.
    data_dir: where prepared data sets live (default: ``default_data_dir()``).
    seq_len: tokens per text example (default ``DEFAULT_SEQ_LEN``); it sets
      the LM split sizes, counted in windows.
    image_size: crop side for data sets of variable image size (ImageNet).
    download: prepare a data set that needs a download if it is missing.
    slices: further split names to count in ``splits``, such as
      "train[:90%]" (``_splits.resolve_split``).

  Returns:
    A ``DatasetInfo``.

  Raises:
    ValueError: as ``_splits.resolve_split`` for a bad entry of ``slices``.
  """
  e, builder = open_builder(name, data_dir, download=download)
  check_kind(name, e, seq_len=seq_len, image_size=image_size)
  text_len = None if e.kind == "image" else (seq_len or DEFAULT_SEQ_LEN)

  def count(split):
    if e.kind == "stream":
      return len(_text.WindowSource(builder, split, seq_len=text_len, separator=e.separator))
    return _splits.resolve_split(name, builder, split).size
  splits = {split: count(split) for split in (*builder.info.splits, *slices)}
  return DatasetInfo(
      name=name,
      task=tasks.LM if e.kind == "stream" else tasks.CLASSIFICATION,
      input_key="image" if e.kind == "image" else "tokens",
      byte_level=e.kind != "image",  # every text data set is read as bytes (``_text``)
      num_classes=None if e.kind == "stream" else builder.info.features["label"].num_classes,
      image_shape=image_shape(builder, image_size) if e.kind == "image" else None,
      vocab_size=None if e.kind == "image" else VOCAB_SIZE,
      seq_len=text_len,
      splits=splits,
      description=builder.info.description,
      flip=e.flip,
  )
