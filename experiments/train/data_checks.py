"""The data that a setting trains and is studied on, checked before the first step.

``check_data(config)`` opens every data set the runs read (the base set and a
transfer set) and checks that their splits exist and fit the batch and the
model, and that the validation split is held out from training.
"""

from __future__ import annotations

import ml_collections

from experiments.train import inputs


def _check_splits(config: ml_collections.ConfigDict, dataset: str) -> None:
  """Raises ValueError if a split of ``config.dataset`` does not fit ``dataset``, or if the
  validation split shares records with the training split."""
  d = config.dataset
  t = inputs.split_range(config, "dataset.train_split", dataset)
  if not d.validation_split:
    return
  v = inputs.split_range(config, "dataset.validation_split", dataset)
  shared = inputs.shared_records(t, v)
  if shared is not None:
    raise ValueError(
        f"config.dataset.validation_split {d.validation_split!r} shares records "
        f"[{shared[0]}, {shared[1]}) of split {t.base!r} of {dataset!r} "
        f"with config.dataset.train_split {d.train_split!r}; the validation loss must be "
        "held out from training")


def check_data(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError if a data set is too small for the batch or does not fit the model.

  The data set B of an A->B transfer must give the model the same input and
  output sizes as A. Each data set must have ``config.dataset.train_split``
  and (if set) ``validation_split``, and the two must share no record; the
  data set the study reads must have ``config.study.eval_split``.
  """
  datasets = {config.dataset.name}
  if config.reinit.scopes:
    datasets.add(config.reinit.dataset or config.dataset.name)
  for name in sorted(datasets):
    _check_splits(config, name)
  if config.reinit.scopes:
    inputs.split_range(config, "study.eval_split", config.reinit.dataset or config.dataset.name)
  train_split = config.dataset.train_split
  infos = {name: inputs.dataset_info(config, name, slices=[train_split]) for name in datasets}
  for name, info in infos.items():
    if info.splits[train_split] < config.train.batch_size:
      raise ValueError(f"config.train.batch_size {config.train.batch_size} is larger than the "
                       f"train split {train_split!r} of {name!r} "
                       f"({info.splits[train_split]} examples)")
  a = inputs.model_overrides(infos[config.dataset.name])
  for name, info in infos.items():
    b = inputs.model_overrides(info)
    if a != b:
      diffs = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
      raise ValueError(f"config.reinit.dataset {name!r} does not fit the model of "
                       f"{config.dataset.name!r}: (base, transfer) differ in {diffs}")
