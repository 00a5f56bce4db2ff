"""Fingerprints: what each stage of a run depends on, and which of it changed.

A stage's inputs are a flat dict of named fields ("train.learning_rate":
0.003, "sha256 of base params": "<hex>", ...), stored as JSON next to the stage's
state; its fingerprint is the sha256 of that dict. A rerun compares the
stored dict with the current one: a finished stage whose fields are equal is
skipped; one whose fields differ is recomputed, with one log line naming the
fields (``describe_changes``: ``train.learning_rate 0.003 -> 0.001``), and so
is everything downstream, because the downstream stages hold the upstream
content hashes among their fields.

Stages and their fields:

* base run (``train/trainer.py``, ``workdir/base/fingerprint.json``): ``seed``,
  ``dataset.name``, ``TRAINING`` (the model's family, preset and every
  override; the reader options; batch size and optimiser),
  ``TRAIN_SCHEDULE``, and ``STOPPING`` when it follows the stopping rule
  (``reinit.stop_base`` with ``reinit.patience`` > 0).
* re-initialised run ``reinit/<scope>/seed_<s>``: its scope and seed, the data
  set it trains on (``reinit.dataset``, or ``dataset.name`` when empty),
  ``TRAINING``, its schedule (``REINIT_SCHEDULE`` when fine-tuning a scope,
  ``TRAIN_SCHEDULE`` for the "full" scope, which trains from scratch),
  ``STOPPING`` when the stopping rule is on (``reinit.patience`` > 0: the
  rule's fields, the validation split and ``dataset.validation_examples``
  unless 0, ``UNKEYED_DEFAULTS``; with the rule off they change
  nothing and are not keyed, so turning it on retrains), and, for every scope
  but "full", ``sha256 of base params``: the content hash of the base model's
  final parameters.
* study stage (``scope_study.py``, one JSON per pair and stage under
  ``study/<scope>/pairs/``): the scope's parameter paths, the content hashes
  of both endpoints and of the evaluation examples (through which the data
  set and the reader's options enter: the fields whose ``study`` is
  ``DATA``), and the config fields that the stage reads, as
  ``experiments/setting/config_schema.py`` says field by field:

  - every stage: the fields whose ``study`` names ``EVERY_STAGE`` (the model,
    ``study.num_lambdas``, ``study.eval_examples``, ``study.eval_split``);
  - a stage computing a matching method: the fields of the ``align_model``
    options the method reads (``Field.option`` of each of
    ``matching.METHODS[method].options``: ``study.distance`` for Stage 1 of
    every method but "naive", the ``study.match_*`` refinement options for
    "full" and "learned") and those whose ``study`` names the method (the
    "learned" method's ``study.learn_*``, and the training and validation
    slices and batch sizes it learns from and chooses its iterate on);
  - the ablations: the "full" method's options (but the refinement schedule,
    for the ablation over every head order), the distance an ablation sets
    as "ablation distance";
  - the robustness check: every compared method's fields and those whose
    ``study`` names ``ROBUSTNESS`` (``seed``, ``study.noise_levels``,
    ``study.methods``).

  A field whose ``unkeyed_default`` is set keys nothing at that value
  (``UNKEYED_DEFAULTS``: ``study.eval_split`` at "test", say, so that results
  stored before the field existed stay valid).
  ``tests/test_study_keys.py`` records the config fields each stage reads and
  fails if one is not keyed.
* report (``study/report_fingerprints.json``): the content hash of the
  results it is drawn from.

Which group each config field keys is its ``keys`` entry in
``experiments/setting/config_schema.py`` (``config_schema.Role``); the groups here
derive from it. Fields deliberately left out (``NOT_KEYED``), because they
change no stored result beyond the float32 rounding of sums:

* when the loss is logged and the model evaluated on the way (such as
  ``train.log_every``, ``train.eval_every``): neither touches the parameters,
  the data order or the random state, and the final evaluation is always at
  the last step. They change ``metrics.jsonl`` only.
* which steps are saved and kept (``train.checkpoint_every``,
  ``train.keep_checkpoints``), not the values (a resumed run is bit-identical).
* reader processes (``dataset.num_workers``): batch k is the same examples.
* how one computation is split (``train.eval_batch_size``, ``study.lambda_chunk``:
  how many evaluation examples and interpolation points one call takes), like
  the number of devices: another split changes the float32 rounding of the
  sums and nothing else (``lambda_chunk`` 1 -> 5 moved the runlocal study's
  path losses by at most 7e-8 relative); results computed with another split
  are kept. Under the stopping rule an evaluation decides when a run stops, so
  another ``eval_batch_size`` could in principle move the stop, if a
  validation loss fell within float32 rounding of the ``min_delta``
  threshold; like the number of devices, it is left out all the same. The
  "learned" method's stages key ``eval_batch_size`` (a ``Role.STUDY``
  field): the method picks its iterate on ``study.learn_holdout_batches``
  batches of that size, so the size chooses the examples it is held out on.
* which runs and stages exist (such as ``reinit.scopes``, ``reinit.seeds``,
  ``study.distances``, ``study.permutation_ablation``): each run and stage is
  keyed by its own scope, seed, method or distance, so adding one adds its
  stages and keeps the rest. ``study.methods`` is one of them for every stage
  but the robustness check, which measures every method and so keys it.
* the library versions.

A field's ``unkeyed_default`` in the schema (``UNKEYED_DEFAULTS`` here) is a
value at which it keys nothing: a field added after results were stored, at
the value those results stand for, so that they stay valid.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import ml_collections
import numpy as np

from attn_symmetry import runtime
from experiments.setting import config_schema
from experiments.workdir import atomic_io

log = logging.getLogger(__name__)

# The field groups, from each field's Role in experiments/setting/config_schema.py.
# Fields of every training run: the model, the data reader, the batch and the optimiser.
TRAINING = config_schema.keyed_by(config_schema.Role.TRAINING)
# The schedule of the base run and of the "full" scope.
TRAIN_SCHEDULE = config_schema.keyed_by(config_schema.Role.TRAIN_SCHEDULE)
# The schedule of a fine-tuned scope.
REINIT_SCHEDULE = config_schema.keyed_by(config_schema.Role.REINIT_SCHEDULE)
# The stopping rule, keyed for every run that follows it (``runs.stopping``: the re-initialised
# runs when reinit.patience > 0, and the base run with reinit.stop_base too).
STOPPING = config_schema.keyed_by(config_schema.Role.STOPPING)
# Fields that key study stages only (each stage keys those it reads: ``scope_study.py``, from
# each field's ``study`` and ``option`` in the schema); no run keys them.
STUDY = config_schema.keyed_by(config_schema.Role.STUDY)
# Keyed per run or stage, by the value that run or stage uses (see the module docstring).
PER_RUN = config_schema.keyed_by(config_schema.Role.PER_RUN)
NOT_KEYED = config_schema.keyed_by(config_schema.Role.NOT_KEYED)
# Fields added after results were stored, with the value they had before: at it they key
# nothing (``config_fields`` leaves them out), so those results stay valid.
UNKEYED_DEFAULTS = config_schema.unkeyed_defaults()

RECORD = "fingerprint.json"
# Fields that hold the content hash of an input (an upstream checkpoint, the evaluation
# data) rather than a config value are named "sha256 of <input>".
INPUT = "sha256 of "


def tree_digest(tree: Any) -> str:
  """sha256 over every leaf's path, dtype, shape and bytes (the content hash of a tree).

  Works for host and device arrays and any pytree (parameters, optimiser states,
  batches). A jax.Array is hashed whole however it is placed (``runtime.host_array``:
  replicated, split over this process's devices or over several processes', where every
  process must hash the same tree), so a tree has one digest whatever the mesh and the
  number of processes that hold it.
  """
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    leaf = np.ascontiguousarray(runtime.host_array(leaf))
    h.update(f"{jax.tree_util.keystr(path)}:{leaf.dtype.name}:{leaf.shape};".encode())
    h.update(leaf.tobytes())
  return h.hexdigest()


def _flat(prefix: str, value: Any) -> dict[str, Any]:
  if isinstance(value, Mapping):
    out = {}
    for k, v in value.items():
      out.update(_flat(f"{prefix}.{k}", v))
    return out
  return {prefix: value}


def config_fields(config: ml_collections.ConfigDict, names: Iterable[str]) -> dict[str, Any]:
  """{"train.learning_rate": 0.003, "model.overrides.width": 64, ...}: the named
  fields of ``config``, a sub-config given by name flattened into its leaves,
  as JSON reads them back (tuples become lists); a field of ``UNKEYED_DEFAULTS`` at
  its value there is left out."""
  out = {}
  for name in names:
    node = config
    for part in name.split("."):
      node = node[part]
    if name in UNKEYED_DEFAULTS and node == UNKEYED_DEFAULTS[name]:
      continue
    if isinstance(node, ml_collections.ConfigDict):
      node = node.to_dict()
    out.update(_flat(name, node))
  return json.loads(json.dumps(out))


def key(fields: Mapping[str, Any]) -> str:
  """The fingerprint: sha256 of the fields as sorted JSON."""
  return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _show(name: str, value: Any) -> str:
  if value is None:
    return "(none)"
  if name.startswith(INPUT) and isinstance(value, str):
    return value[:12]
  return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def changed(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
  """The names of the fields that differ (present in one only, or unequal), sorted."""
  return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def describe_changes(old: Mapping[str, Any], new: Mapping[str, Any], most: int = 4) -> str:
  """E.g. "train.learning_rate 0.003 -> 0.001, train.num_steps 8 -> 12": the changed config
  fields first, then the changed content hashes."""
  names = sorted(changed(old, new), key=lambda k: k.startswith(INPUT))
  parts = [f"{k} {_show(k, old.get(k))} -> {_show(k, new.get(k))}" for k in names[:most]]
  if len(names) > most:
    parts.append(f"and {len(names) - most} more")
  return ", ".join(parts)


def change_line(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
  """"config changed (<describe_changes>)" when a config field is among the changed fields
  (a content hash that changed too is listed after them), else "inputs changed (...)":
  only an upstream content hash changed."""
  by_config = any(not k.startswith(INPUT) for k in changed(old, new))
  return f"{'config' if by_config else 'inputs'} changed ({describe_changes(old, new)})"


def read_record(directory: str) -> dict[str, Any] | None:
  """The fields stored in ``directory/fingerprint.json``; None if missing or damaged
  (a damaged record warns, naming the file)."""
  record = atomic_io.read_json_or_none(os.path.join(directory, RECORD), "fingerprint record")
  if isinstance(record, dict) and isinstance(record.get("fields"), dict):
    return record["fields"]
  if record is not None:
    log.warning("fingerprint record %s has no fields; treated as missing",
                os.path.join(directory, RECORD))
  return None


def write_record(directory: str, fields: Mapping[str, Any]) -> None:
  """Stores ``fields`` (and their fingerprint) in ``directory/fingerprint.json``, atomically."""
  atomic_io.write_json(os.path.join(directory, RECORD),
                       {"fingerprint": key(fields), "fields": dict(fields)}, indent=1,
                       sort_keys=True)


def move_aside(path: str, label: str = "stale", into: str | None = None) -> str:
  """Renames ``path`` to ``<into>/<name>.<label>-<YYYYmmdd-HHMMSS>[-n]`` (``into``: the
  folder of ``path`` by default); never deletes. Returns the new path."""
  stem = os.path.join(into or os.path.dirname(os.path.abspath(path)), os.path.basename(path))
  stamp = time.strftime("%Y%m%d-%H%M%S")
  target, n = f"{stem}.{label}-{stamp}", 1
  while os.path.exists(target):
    target, n = f"{stem}.{label}-{stamp}-{n}", n + 1
  if into:
    os.makedirs(into, exist_ok=True)
  os.rename(path, target)
  return target
