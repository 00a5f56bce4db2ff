"""The saved runs of a setting, read back as the study reads them: verified, never trained.

``load_checkpoints`` gives every run's final parameters, checked against the
run's fingerprint (``runs.run_fields``) and the content hash saved with them;
``steps_taken`` says how each run ended. Neither trains nor writes anything:
the study reads the runs that ``trainer.py`` left in the workdir.
"""

from __future__ import annotations

from typing import Any

import jax
import ml_collections

from experiments.setting import fingerprints
from experiments.train import checkpoints
from experiments.train import inputs
from experiments.train import runs as runs_lib
from experiments.train import schedules

Params = dict[str, Any]


def load_checkpoints(config: ml_collections.ConfigDict, workdir: str, *,
                     require_complete: bool = False, on_host: bool = False
                     ) -> dict[str, Params]:
  """The parameters of the latest checkpoint of every run of ``config``, by run name.

  Names are those of ``runs.runs(config)``: "base", "reinit/<scope>/seed_<s>".
  Arrays are placed on the devices as training places them
  (``config.train.param_sharding``: replicated, or split), and verified against
  the content hash saved with them.

  Args:
    config: the setting.
    workdir: where it was trained.
    require_complete: refuse a run that is unfinished: neither at the last
      step of its schedule nor stopped by the stopping rule.
    on_host: each run as numpy arrays (``inputs.to_host``), copied off the
      devices as soon as it is verified, so that the devices hold one run at a
      time, not every run (the study's host copies).

  Raises:
    ValueError: a run has no checkpoint (not trained yet), checkpoints of
      another architecture than ``config``'s model (naming the parameters), or
      was trained with other config fields or inputs than ``config`` gives
      (naming them), or (``require_complete``) is not finished.
    checkpoints.CorruptCheckpointError: a checkpoint is damaged or cannot be
      verified (one line naming it).
  """
  model = inputs.create_model(config)
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  arch = checkpoints.architecture(model.config.family, shapes)
  place = inputs.placement(inputs.create_mesh(), config.train.param_sharding)
  abstract = checkpoints.abstract_like(shapes, place)
  out, base_digest = {}, None
  for run in runs_lib.runs(config):
    directory = runs_lib.run_dir(workdir, run)
    checkpoints.check_architecture(directory, arch)
    ckpts = checkpoints.RunCheckpoints(directory, read_only=True)
    try:
      out[run.name], digest = _load_run(config, run, ckpts, abstract, base_digest,
                                        require_complete)
    finally:
      ckpts.close()
    if on_host:
      out[run.name] = inputs.to_host(out[run.name])
    if run.name == "base":
      base_digest = digest
  return out


def _load_run(config, run, ckpts, abstract, base_digest, require_complete):
  """(params, their content hash) of ``run``'s latest checkpoint, checked as
  ``load_checkpoints`` says."""
  directory = ckpts.run_dir
  step = ckpts.latest_step()
  if step is None:
    raise ValueError(f"run {run.name!r} has no checkpoint in {ckpts.directory}; train it first")
  fields = runs_lib.run_fields(config, run, base_digest if run.fine_tunes else None)
  old = fingerprints.read_record(directory)
  if old is None:
    raise ValueError(f"run {run.name!r} in {directory} has no readable {fingerprints.RECORD} "
                     "(trained before runs recorded their config); rerun training, which "
                     "moves it aside and trains it again")
  if old != fields:
    raise ValueError(f"run {run.name!r} in {directory} was trained with other fields: "
                     f"{fingerprints.change_line(old, fields)}; rerun training first")
  num_steps = runs_lib.schedule(config, run).num_steps
  if require_complete and schedules.ended(ckpts.restore_meta(step), step, num_steps) is None:
    raise ValueError(f"run {run.name!r} stopped at step {step} of {num_steps} "
                     f"({ckpts.directory}); rerun training to finish it")
  return ckpts.restore_params(step, abstract), ckpts.digest(step)


def steps_taken(config: ml_collections.ConfigDict, workdir: str) -> dict[str, dict[str, Any]]:
  """How every run of ``config`` in ``workdir`` ended, by run name, from the meta of its
  newest checkpoint (the one ``load_checkpoints`` loads).

  Returns:
    {"base": {"steps": 500, "stopped": "budget", "num_steps": 500},
    "reinit/first_attention/seed_1": {"steps": 275, "stopped": "plateau",
    "num_steps": 1000, "validation_loss": 0.121, "best_validation_loss": 0.118,
    "best_step": 175}, ...}: the step reached, "plateau" or "budget" (None
    for an unfinished run), the budget, and, for runs under the stopping
    rule, the validation loss at the last step, the best one and its step.

  Raises:
    ValueError: a run has no checkpoint.
    checkpoints.CorruptCheckpointError: a checkpoint's meta cannot be read.
  """
  out = {}
  for run in runs_lib.runs(config):
    ckpts = checkpoints.RunCheckpoints(runs_lib.run_dir(workdir, run), read_only=True)
    try:
      step = ckpts.latest_step()
      if step is None:
        raise ValueError(f"run {run.name!r} has no checkpoint in {ckpts.directory}; "
                         "train it first")
      meta = ckpts.restore_meta(step)
    finally:
      ckpts.close()
    num_steps = runs_lib.schedule(config, run).num_steps
    out[run.name] = {"steps": step, "stopped": schedules.ended(meta, step, num_steps),
                     "num_steps": num_steps}
    rule = runs_lib.stopping(config, run)
    if rule is not None:
      out[run.name].update(schedules.Plateau.from_meta(rule, meta.get("stopping")).record())
  return out
