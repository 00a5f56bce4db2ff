"""Training: the base model, then every re-initialised seed (docs/lmc.md, 'Re-initialisation').

``train_and_evaluate(config, workdir)`` checks the config and the workdir,
then trains, in order, the runs that ``runs.runs(config)`` lists, each in its
directory (``runs.run_dir``). Each run keeps in ``fingerprint.json`` the
config fields and inputs it depends on (``runs.run_fields``): a run whose
fields are unchanged is skipped when complete and resumed from its newest
intact checkpoint when not; one whose fields changed is moved aside to
``<run dir>.stale-<time>`` (never deleted) and trained again, with one log
line naming the fields. A complete run's final parameters are verified
(``checkpoints.py``) before it is skipped. In every run directory:
``checkpoints/<step>/`` (``checkpoints.py``), ``metrics.jsonl`` and
TensorBoard event files (``metric_writers.py``), ``fingerprint.json``, and
``final_metrics.json`` (the test evaluation of the last step, how many steps
the run took and why it stopped; written atomically). Checkpoints are
verified on restore: a damaged one is moved to ``corrupt_checkpoints/`` and
training falls back to the newest intact one, saying so.

The pieces: ``runs.py`` (which runs, where, their fingerprints),
``schedules.py`` (the schedule and the stopping rule), ``optimizer.py`` (the
optimiser and the jitted step), ``data_checks.py`` (the data checked before
the first step), ``loop.py`` (one run's loop from its restored step to its
end); ``saved_runs.py`` gives the study the trained runs without this module.

Data parallelism: a ``jax.sharding.Mesh`` over all devices with one axis
"data"; every batch is split along it and the parameters and optimiser state
are replicated, so XLA inserts the gradient all-reduce. With
``config.train.param_sharding = "fsdp"`` they are split over the same axis
instead (``inputs.placement``), each device holding about 1/N of them: XLA
gathers each leaf where the step needs it and reduce-scatters its gradient,
the same steps up to float32 rounding; a fresh model is initialised by a
program compiled for its split placement, so that it is never whole on one
device (its values differ from the eager initialisation of the replicated
runs in the last bits). Checkpoints hold the global arrays, restored into
whichever placement the restoring run uses: a run resumes split from a
replicated run's checkpoint, and the reverse. Several processes
(one per host, or several on one: ``main.py --num_processes``): each process
reads its own share of every batch (``config.train.batch_size`` is global, and
so is the validation subset: ``inputs.first_examples``), every process takes
every step, and process 0 alone decides from the workdir's files and writes
them (``processes.py``): it checks and records each run's fingerprint and moves
stale state aside while the others wait, decides whether a run is complete, and
writes metrics and ``final_metrics.json``; orbax writes the checkpoints
(replicated arrays once). The result is that of one process with as many
devices, up to the float32 rounding of the cross-process sums.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import ml_collections

from attn_symmetry import models
from experiments.setting import config_checks
from experiments.setting import fingerprints
from experiments.train import checkpoints
from experiments.train import data_checks
from experiments.train import inputs
from experiments.train import loop as loop_lib
from experiments.train import metric_writers
from experiments.train import optimizer as optimizer_lib
from experiments.train import reinit
from experiments.train import runs as runs_lib
from experiments.train import schedules
from experiments.workdir import atomic_io
from experiments.workdir import processes

Params = dict[str, Any]

# Progress and results; main.py quiets the INFO chatter of other libraries (orbax) but not this.
log = logging.getLogger(__name__)
log.setLevel(logging.INFO)


class Trainer:
  """Trains the runs of one config in one workdir.

  Args:
    config: the setting (checked with ``config_checks.validate``).
    model: ``inputs.create_model(config)``.
    workdir: root of the layout in the module docstring.
    mesh: device mesh with a "data" axis (default: all devices).
  """

  def __init__(self, config: ml_collections.ConfigDict, model: models.Model, workdir: str, *,
               mesh: jax.sharding.Mesh | None = None):
    self.config, self.model, self.workdir = config, model, workdir
    self.mesh = inputs.create_mesh() if mesh is None else mesh
    self._place = inputs.placement(self.mesh, config.train.param_sharding)
    self._base = None

  def _base_digest(self) -> str:
    """The content hash of the base model's final parameters (from its checkpoint's meta)."""
    base = runs_lib.runs(self.config)[0]
    ckpts = checkpoints.RunCheckpoints(runs_lib.run_dir(self.workdir, base), read_only=True)
    try:
      return ckpts.digest(ckpts.latest_step())
    finally:
      ckpts.close()

  def fields(self, run: runs_lib.Run) -> dict[str, Any]:
    """``runs.run_fields`` of ``run``; a fine-tuned run's need the base model trained."""
    return runs_lib.run_fields(self.config, run, self._base_digest() if run.fine_tunes else None)

  def _check_fingerprint(self, run: runs_lib.Run, directory: str, fields: dict[str, Any]) -> None:
    """Makes ``directory`` hold only state computed from ``fields``, and records them.

    State computed from other fields, or without a readable record (a run
    from before fingerprints), is moved aside, with one log line naming the
    changed fields. Process 0 reads, decides and moves; the others wait until it
    has (``processes.py``), so that none of them reads the record it is writing.
    """
    def check() -> None:
      old = fingerprints.read_record(directory)
      if old == fields:
        return
      if os.path.isdir(directory) and os.listdir(directory):
        reason = (fingerprints.change_line(old, fields) if old is not None else
                  f"no readable {fingerprints.RECORD} (trained before runs recorded their config)")
        moved = fingerprints.move_aside(directory)
        log.info("%s: %s; retraining, old state moved to %s", run.name, reason, moved)
      fingerprints.write_record(directory, fields)

    processes.on_process_0(check, f"record {directory}")

  def _newest_intact(self, run: runs_lib.Run, ckpts: checkpoints.RunCheckpoints, restore):
    """(step, restore(step)) for the newest checkpoint that restores intact, or None.

    Each damaged newer checkpoint is moved to ``corrupt_checkpoints/`` with a
    warning, so that training falls back to the one before.
    """
    for step in sorted(ckpts.all_steps(), reverse=True):
      try:
        return step, restore(step)
      except checkpoints.CorruptCheckpointError as e:
        moved = ckpts.move_aside(step)
        log.warning("%s: %s; moved it to %s and falling back to the previous checkpoint",
                    run.name, e, moved)
    return None

  def _fresh(self, seed: int) -> Params:
    """The model initialised from ``seed``, placed for training. Replicated runs keep the
    eager initialisation that every stored run had; a split run's is compiled for its
    placement (module docstring)."""
    key = jax.random.key(seed)
    if self.config.train.param_sharding == "replicated":
      return self.model.init(key)
    shapes = jax.eval_shape(self.model.init, key)
    return jax.jit(self.model.init, out_shardings=inputs.shardings(shapes, self._place))(key)

  def _initial_params(self, run: runs_lib.Run):
    """(params, trainable mask, host copy of the base params or None) before training."""
    fresh = self._fresh(run.seed)
    if not run.fine_tunes:
      return fresh, jax.tree.map(lambda _: True, fresh), None
    if self._base is None:
      base_ckpts = checkpoints.RunCheckpoints(
          runs_lib.run_dir(self.workdir, runs_lib.runs(self.config)[0]), read_only=True)
      # A host copy: device arrays given to the training step are donated.
      self._base = inputs.to_host(base_ckpts.restore_params(
          base_ckpts.latest_step(), checkpoints.abstract_like(fresh, self._place)))
      base_ckpts.close()
    trainable = reinit.trainable_mask(self._base, reinit.scope_paths(self.model, run.scope))
    base = jax.device_put(self._base, inputs.shardings(self._base, self._place))
    if run.scope == reinit.SPAWN:  # a child of the base model: nothing re-initialised
      return base, trainable, self._base
    return reinit.reinitialise(base, fresh, trainable), trainable, self._base

  def train(self, run: runs_lib.Run) -> dict[str, Any]:
    """Trains (or resumes, or skips if complete) ``run``; returns its final evaluation.

    Returns:
      {"loss", "accuracy"} on the test split at the run's last step, "steps"
      (that step), "stopped" ("plateau" or "budget"), and, under the stopping
      rule, "validation_loss" (at the last step), "best_validation_loss" and
      "best_step"; also written to ``final_metrics.json``.

    Raises:
      FloatingPointError: a non-finite training loss; the last checkpoint
        saved before it is kept.
      RuntimeError: a frozen parameter changed (cannot happen unless the
        trainer is broken; checked after every fine-tuning).
    """
    directory = runs_lib.run_dir(self.workdir, run)
    self._check_fingerprint(run, directory, self.fields(run))
    ckpts = checkpoints.RunCheckpoints(directory, keep=self.config.train.keep_checkpoints)
    try:
      return self._train(run, directory, ckpts)
    finally:
      ckpts.close()

  def _train(self, run: runs_lib.Run, directory: str, ckpts: checkpoints.RunCheckpoints
             ) -> dict[str, Any]:
    """``train`` with the run's checkpoints open: skip, or train to the end and record it."""
    final_path = os.path.join(directory, "final_metrics.json")
    complete = self._result_if_complete(run, ckpts, final_path)
    saved = processes.from_process_0(lambda: complete)  # every process skips, or none
    if saved is not None:
      return saved
    params, trainable, base = self._initial_params(run)
    loop = self._start_loop(run, directory, ckpts, params, trainable)
    try:
      final = loop.run_to_end()
    finally:
      ckpts.wait()
      loop.writer.close()
    if base is not None:
      changed = reinit.changed_frozen(base, loop.state["params"], trainable)
      if changed:
        raise RuntimeError(f"{run.name}: frozen parameters changed during fine-tuning: {changed}")
    final = {**final, "steps": loop.step, "stopped": loop.how,
             **(loop.plateau.record() if loop.plateau is not None else {})}
    processes.on_process_0(lambda: atomic_io.write_json(final_path, final), f"final {directory}")
    return final

  def _result_if_complete(self, run: runs_lib.Run, ckpts: checkpoints.RunCheckpoints,
                          final_path: str) -> dict[str, Any] | None:
    """The final evaluation saved in ``final_path`` if ``run`` is complete (its newest
    checkpoint intact and recording the run's end), else None."""
    saved = atomic_io.read_json_or_none(final_path, "final evaluation")
    latest = ckpts.latest_step()
    if saved is None or latest is None:
      return None
    abstract = checkpoints.abstract_like(jax.eval_shape(self.model.init, jax.random.key(0)),
                                         self._place)
    intact = self._newest_intact(
        run, ckpts, lambda s: (ckpts.restore_params(s, abstract), ckpts.restore_meta(s)))
    if intact is None or intact[0] != latest:
      return None
    how = schedules.ended(intact[1][1], latest, runs_lib.schedule(self.config, run).num_steps)
    if how is None:
      return None
    log.info("%s: complete (step %d, %s), skipped", run.name, latest, schedules.STOPS[how])
    return saved

  def _start_loop(self, run: runs_lib.Run, directory: str, ckpts: checkpoints.RunCheckpoints,
                  params: Params, trainable: Params) -> loop_lib.RunLoop:
    """The training loop of ``run`` from ``params`` (step 0), or from its newest intact
    checkpoint: parameters, optimiser state, data position and stopping-rule state."""
    sched = runs_lib.schedule(self.config, run)
    optimizer, lr, train_step = optimizer_lib.optimizer_and_step(self.config, self.model, sched,
                                                                 trainable, self.mesh)
    state = {"params": params, "opt_state": optimizer.init(params)}
    batches = inputs.train_batches(self.config, run.dataset, seed=run.seed)
    abstract = checkpoints.abstract_like(state, self._place)
    intact = self._newest_intact(
        run, ckpts, lambda s: ckpts.restore(s, abstract["params"], abstract["opt_state"]))
    start, meta = 0, {}
    if intact is not None:
      start, (state["params"], state["opt_state"], meta) = intact
      batches.set_state(meta["data_state"])
      if schedules.ended(meta, start, sched.num_steps) is None:
        log.info("%s: resuming from step %d in %s", run.name, start, ckpts.directory)
    else:
      state = jax.device_put(state, inputs.shardings(state, self._place))
    rule = runs_lib.stopping(self.config, run)
    plateau = None if rule is None else schedules.Plateau.from_meta(rule, meta.get("stopping"))
    arch = checkpoints.architecture(self.model.config.family, jax.eval_shape(lambda: params))
    writer = metric_writers.MetricWriter(directory, resume_step=start,
                                         enabled=jax.process_index() == 0)
    return loop_lib.RunLoop(
        run=run, config=self.config, model=self.model, mesh=self.mesh, state=state, step=start,
        num_steps=sched.num_steps, how=schedules.ended(meta, start, sched.num_steps),
        batches=batches, train_step=train_step, lr=lr, ckpts=ckpts, writer=writer,
        plateau=plateau, meta={"run": run.name, "architecture": arch})


def check_workdir(config: ml_collections.ConfigDict, model: models.Model, workdir: str) -> None:
  """Raises ValueError if any run directory holds checkpoints of another architecture."""
  arch = checkpoints.architecture(model.config.family,
                                  jax.eval_shape(model.init, jax.random.key(0)))
  for run in runs_lib.runs(config):
    checkpoints.check_architecture(runs_lib.run_dir(workdir, run), arch)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, dict]:
  """Trains the base model and every re-initialised seed; returns final evaluations by run.

  Everything that can be checked is checked before the first step: the
  config (``config_checks.validate``) and its batches' shares over the processes
  (``inputs.check_processes``) unless they were for this run
  (``config_checks.validated``: ``main.py`` checks both once, before every stage), the
  data (``data_checks.check_data``), the model it builds, and the checkpoints already in
  ``workdir``.
  """
  if not config_checks.validated(config):
    config_checks.validate(config)
    inputs.check_processes(config)
  data_checks.check_data(config)
  model = inputs.create_model(config)
  check_workdir(config, model, workdir)
  trainer = Trainer(config, model, workdir)
  log.info("training %d run(s) in %s on %d device(s)%s", len(runs_lib.runs(config)), workdir,
           jax.device_count(), ", parameters and optimiser state split over them (fsdp)"
           if config.train.param_sharding == "fsdp" else "")
  results = {run.name: trainer.train(run) for run in runs_lib.runs(config)}
  width = max(map(len, results))
  log.info("final evaluation:\n%s", "\n".join(
      f"  {name:<{width}}  loss {m['loss']:.4f}  accuracy {m['accuracy']:.4f}"
      for name, m in results.items()))
  return results
