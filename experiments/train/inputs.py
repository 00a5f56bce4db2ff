"""The model, the batches and the device mesh of a config.

The data set (``attn_symmetry.data``) fixes the model's input and output
sizes; ``create_model`` builds the model of ``config.model`` to fit it.
Batches are placed on a 1-D mesh with axis "data": split along it. Parameters
and optimiser state are replicated, a copy on every device, or
(``config.train.param_sharding = "fsdp"``) split over the same axis, each leaf
along its longest axis that the device count divides (``placement``): each
device holds about 1/N of the model, and XLA gathers a leaf where the step
needs it whole and reduces its gradient to the shards (fully sharded data
parallelism, from ``jax.sharding`` annotations alone).

Three splits of a data set are read: ``config.dataset.train_split`` (training
batches), ``config.dataset.validation_split`` (the held-out loss on which a
re-initialised run stops, ``validation_batches``: its first
``config.dataset.validation_examples`` examples, all for 0), and the test split
(``eval_batches``: the evaluations that are reported, and the study's unless
``config.study.eval_split`` names another). No training decision reads the test split.

Several processes (``jax.distributed``): the readers give each process its
share of every global batch (``attn_symmetry.data``: concatenated in process
order, the shares make the global batch), which ``shard_batch`` places on the
process's devices. A subset of a split (``first_examples``) is chosen by the
examples' places in the global batches, so that every process count evaluates
the same examples. With ``whole=True`` every process reads the whole global
batches instead: the study does, so that what it hashes, adds noise to and
learns from is the same in every process and the same as in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import ml_collections
import numpy as np

from attn_symmetry import data
from attn_symmetry import matching
from attn_symmetry import models
from attn_symmetry import runtime
from attn_symmetry import tasks

Batch = Mapping[str, np.ndarray]


def data_options(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Keyword arguments of the ``attn_symmetry.data`` readers; unset options left out."""
  d = config.dataset
  options = dict(data_dir=d.data_dir or None, seq_len=d.seq_len or None,
                 image_size=d.image_size or None, num_workers=d.num_workers or None)
  return {k: v for k, v in options.items() if v is not None}


def dataset_info(config: ml_collections.ConfigDict, dataset: str, *, slices=()
                 ) -> data.DatasetInfo:
  """``attn_symmetry.data.dataset_info`` with the config's reader options; ``slices``
  (split names such as "train[:90%]") are counted in its ``splits`` too."""
  options = data_options(config)
  options.pop("num_workers", None)
  return data.dataset_info(dataset, slices=tuple(slices), **options)


def split_range(config: ml_collections.ConfigDict, field: str, dataset: str
                ) -> data.SplitRange:
  """The records of ``dataset`` that the split named by config ``field`` reads
  ("dataset.train_split", "study.eval_split": ``data.split_range``).

  Raises:
    ValueError: one line naming the field: ``dataset`` has no such split or slice.
  """
  section, name = field.split(".")
  value = config[section][name]
  try:
    return data.split_range(dataset, value, data_dir=data_options(config).get("data_dir"))
  except ValueError as e:
    raise ValueError(f"config.{field} {value!r} does not fit: {e}") from None


def shared_records(a: data.SplitRange, b: data.SplitRange) -> tuple[int, int] | None:
  """[start, stop) of the records that two split ranges share, or None if they share none."""
  start, stop = max(a.start, b.start), min(a.stop, b.stop)
  return (start, stop) if a.base == b.base and start < stop else None


# The data a model of each task trains on (``data.DatasetInfo.task``): a masked-LM model reads
# the windows of a byte or token stream, as a language model does.
DATA_TASK = {tasks.CLASSIFICATION: tasks.CLASSIFICATION, tasks.LM: tasks.LM, tasks.MLM: tasks.LM}


def model_overrides(info: data.DatasetInfo, *, mask_token: bool = False) -> dict[str, Any]:
  """The model config fields that a data set fixes: input and output sizes (one more id in
  the vocabulary with ``mask_token``: a masked-LM model's ``evaluation.mask_token``)."""
  out = {}
  if info.task == tasks.CLASSIFICATION:
    out["num_classes"] = info.num_classes
  if info.image_shape is not None:
    height, width, channels = info.image_shape
    if height != width:
      raise ValueError(f"data set {info.name!r} has non-square images {info.image_shape}")
    out.update(image_size=height, num_channels=channels)
  else:
    out.update(vocab_size=info.vocab_size + mask_token, max_len=info.seq_len)
  return out


def create_model(config: ml_collections.ConfigDict) -> models.Model:
  """The model of ``config.model``, sized for the base data set.

  The data set fixes the input and output sizes (``model_overrides``, with a
  mask token for a masked-LM model); ``config.model.overrides`` is applied on top.

  Raises:
    ValueError: the model reads another kind of input than the data set holds
      (a ViT on text), or its task needs other data (a classifier on a byte
      stream, a language model on labelled texts: ``DATA_TASK``).
  """
  info = dataset_info(config, config.dataset.name)
  build = lambda sizes: models.build(config.model.family, config.model.preset,
                                     **{**sizes, **config.model.overrides.to_dict()})
  model = build(model_overrides(info))
  if model.input_key != info.input_key:
    raise ValueError(f"config.model.family {config.model.family!r} reads {model.input_key!r} "
                     f"inputs; data set {info.name!r} holds {info.input_key!r}")
  if DATA_TASK[model.task] != info.task:
    raise ValueError(
        f"config.model: {config.model.family} with head {model.config.head!r} is a "
        f"{model.task!r} model, which trains on {DATA_TASK[model.task]!r} data; data set "
        f"{info.name!r} holds {info.task!r} data")
  return build(model_overrides(info, mask_token=True)) if model.task == tasks.MLM else model


def _reader_processes(whole: bool) -> dict[str, int]:
  """The ``process_index`` and ``process_count`` a reader is given: this process's share,
  or (``whole``) the global batches, as one process reads them."""
  if whole:
    return {"process_index": 0, "process_count": 1}
  return {"process_index": jax.process_index(), "process_count": jax.process_count()}


def check_processes(config: ml_collections.ConfigDict, count: int | None = None) -> None:
  """Raises ValueError naming the config field whose batch ``count`` processes (default
  ``jax.process_count()``) cannot share: each reads batch_size / count examples of every
  batch."""
  count = jax.process_count() if count is None else count
  for field in ("batch_size", "eval_batch_size"):
    if config.train[field] % count:
      raise ValueError(f"config.train.{field} {config.train[field]} is not divisible by the "
                       f"{count} processes: each reads an equal share of every batch")


def train_batches(config: ml_collections.ConfigDict, dataset: str, *, seed: int,
                  whole: bool = False, augment: bool | None = None):
  """This process's share of the training batches of ``config.dataset.train_split``, endless
  (``whole``: every process the whole global batches), augmented as ``config.dataset.augment``
  says unless ``augment`` does (then that field is not read).

  The iterator has grain's ``get_state`` and ``set_state``: the data position
  that checkpoints save, so that a resumed run reads the batches it would have.
  """
  options = data_options(config)
  if config.dataset.augment if augment is None else augment:
    options["augment"] = True
  return data.train_iterator(dataset, batch_size=config.train.batch_size, seed=seed,
                             split=config.dataset.train_split, **_reader_processes(whole),
                             **options)


def _pass(config: ml_collections.ConfigDict, dataset: str, split: str, limit: int,
          whole: bool) -> Iterator[Batch]:
  """One pass over the first ``limit`` examples of ``split`` (all for 0): the shares of this
  process, or (``whole``) the global batches."""
  processes = _reader_processes(whole)
  return first_examples(data.eval_iterator(dataset, batch_size=config.train.eval_batch_size,
                                           split=split, **processes, **data_options(config)),
                        limit, **processes)


def eval_batches(config: ml_collections.ConfigDict, dataset: str, split: str = "test", *,
                 limit: int = 0, whole: bool = False) -> Iterable[Batch]:
  """This process's share of one pass over the first ``limit`` examples of ``split`` (the
  test split by default, all of it for 0; the study reads the first
  ``config.study.eval_examples`` of ``config.study.eval_split``), batches with "valid"
  (``whole``: every process the whole global batches)."""
  return _pass(config, dataset, split, limit, whole)


def validation_batches(config: ml_collections.ConfigDict, dataset: str, *, whole: bool = False
                       ) -> Iterator[Batch]:
  """This process's share of the first ``config.dataset.validation_examples`` examples of
  ``config.dataset.validation_split`` (all of it for 0), batches with "valid" (as
  ``eval_batches``; ``whole``: every process the whole global batches).

  Raises:
    ValueError: the config names no validation split.
  """
  split = config.dataset.validation_split
  if not split:
    raise ValueError("config.dataset.validation_split is empty: there is no held-out split "
                     "to validate on")
  return _pass(config, dataset, split, config.dataset.validation_examples, whole)


def first_examples(batches: Iterable[Batch], limit: int, *, process_index: int = 0,
                   process_count: int = 1) -> Iterator[dict[str, np.ndarray]]:
  """The batches that hold the first ``limit`` examples of a pass (every batch for 0), with
  ``valid`` False past them: a fixed subset of the split read, in its stored order. Read
  lazily: no batch past the subset is read.

  ``batches`` are one process's shares of the global batches (``process_index`` of
  ``process_count``; the defaults: the global batches themselves). Row i of share k holds
  the example at place (k P + p) b + i of the pass, b rows per share (the readers' layout,
  ``attn_symmetry.data``), and the subset is the places below ``limit``: the same examples
  whatever the number of processes. A pass holds its valid examples first (the padding of
  its last batch follows them), so these are its first ``limit`` valid examples.
  """
  for k, batch in enumerate(batches):
    valid = np.asarray(batch["valid"], bool)
    if limit:
      rows = len(valid)
      valid = valid & ((k * process_count + process_index) * rows + np.arange(rows) < limit)
    yield {**batch, "valid": valid}
    if limit and (k + 1) * process_count * len(valid) >= limit:
      return


def create_mesh(devices=None) -> jax.sharding.Mesh:
  """A 1-D mesh with axis "data" over ``devices`` (default: all devices)."""
  devices = jax.devices() if devices is None else devices
  return jax.sharding.Mesh(np.asarray(devices), ("data",))


def shard_batch(batch: Batch, mesh: jax.sharding.Mesh, *, whole: bool = False
                ) -> dict[str, jax.Array]:
  """Global arrays from this process's share of a batch (``whole``: from the whole global
  batch, which every process holds), split along the mesh's data axis."""
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  if whole:
    return {k: jax.make_array_from_callback(np.shape(v), sharding,
                                            lambda index, v=np.asarray(v): v[index])
            for k, v in batch.items()}
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
          for k, v in batch.items()}


def replicated(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
  """The sharding of parameters and optimiser state: a full copy on every device."""
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


# How a run's parameters and optimiser state are placed on the mesh (config.train.param_sharding).
PARAM_SHARDINGS = ("replicated", "fsdp")


def placement(mesh: jax.sharding.Mesh, how: str = "replicated"
              ) -> Callable[[tuple[int, ...]], jax.sharding.NamedSharding]:
  """The sharding of a parameter or optimiser-state leaf, as a function of its shape.

  "replicated": a full copy on every device (``replicated``). "fsdp": split over the
  mesh's devices along the leaf's longest axis that their count divides, replicated
  where none does (scalars: Adam's step count) (``attn_symmetry.matching.leaf_sharding``).
  """
  if how not in PARAM_SHARDINGS:
    raise ValueError(f"unknown parameter sharding {how!r}; choose from {PARAM_SHARDINGS}")
  if how == "fsdp":
    return lambda shape: matching.leaf_sharding(shape, mesh)
  return lambda shape: replicated(mesh)


def shardings(tree: Any, place: Callable[[tuple[int, ...]], jax.sharding.Sharding]) -> Any:
  """The tree of ``place``'s sharding for every leaf of ``tree`` (arrays or shape structs)."""
  return jax.tree.map(lambda x: place(tuple(np.shape(x))), tree)


def on_mesh(tree: Any, mesh: jax.sharding.Mesh) -> Any:
  """``tree`` with its leaves on ``mesh``: a leaf already placed on it is kept as it is
  (replicated or split), any other is replicated (``replicate``)."""
  def put(x):
    if (isinstance(x, jax.Array) and isinstance(x.sharding, jax.sharding.NamedSharding)
        and x.sharding.mesh == mesh):
      return x
    return replicate(x, mesh)
  return jax.tree.map(put, tree)


def replicate(tree: Any, mesh: jax.sharding.Mesh) -> Any:
  """A copy of every leaf on every device of ``mesh`` (``replicated``), from host or
  one-device arrays that every process holds the same (leaves already replicated on the
  mesh are kept). Each process fills its own devices from its own copy, without comparing."""
  sharding = replicated(mesh)

  def put(x):
    if isinstance(x, jax.Array) and x.sharding == sharding:
      return x
    return jax.make_array_from_callback(np.shape(x), sharding,
                                        lambda index, x=np.asarray(x): x[index])
  return jax.tree.map(put, tree)


def to_host(tree: Any) -> Any:
  """Numpy copies of the whole arrays of ``tree``, however they are placed
  (``attn_symmetry.runtime.host_array``; split over several processes: every process
  must call it on the same tree)."""
  return jax.tree.map(runtime.host_array, tree)
