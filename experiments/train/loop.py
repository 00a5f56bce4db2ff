"""One run's training loop: from its restored step to its end, chunk by chunk.

``RunLoop.run_to_end`` trains the steps up to the next one at which anything
falls due (logging, test evaluation, a checkpoint, validation under the
stopping rule, the budget's last step), then checks that their losses are
finite, logs, decides whether the run ends (``schedules.Plateau``), evaluates
and saves a checkpoint. ``trainer.py`` builds the loop of each run.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np
import optax

from attn_symmetry import models
from experiments.train import checkpoints
from experiments.train import evaluation
from experiments.train import inputs
from experiments.train import metric_writers
from experiments.train import runs
from experiments.train import schedules

# Progress lines; main.py quiets the INFO chatter of other libraries (orbax) but not this.
log = logging.getLogger(__name__)
log.setLevel(logging.INFO)


def _first_nonfinite(steps: list[int], metrics: list[dict[str, np.ndarray]]):
  """(step, loss) of the first non-finite training loss, or None.

  The run stops there, keeping its last good checkpoint (``RunLoop.check_finite``), rather
  than skipping the step as ``optax.apply_if_finite`` would: a skipped step
  leaves a run that no longer follows its schedule and data order, which the
  study's reruns and resumes rely on to reproduce it bit for bit.
  """
  for step, m in zip(steps, metrics):
    if not np.isfinite(m["loss"]):
      return step, m["loss"]
  return None


@dataclasses.dataclass
class RunLoop:
  """One run's training from its restored step to its end: the state carried from one
  chunk of steps to the next, and the named steps that end a chunk (``run_to_end``).

  A chunk is the steps up to the next one at which anything falls due (``due``:
  logging, test evaluation, a checkpoint, validation, or the budget's last step).
  The device takes them without the host waiting; then the host checks their
  losses, logs, validates (which may end the run), evaluates and saves.

  Attributes:
    run: the run.
    config: its setting.
    model: its model.
    mesh: the mesh that every batch is split over.
    state: {"params", "opt_state"}, placed as ``config.train.param_sharding``
      says; every step donates it and returns the next.
    step: the last step taken (at the start, the restored one; 0 for a new run).
    num_steps: the budget: the schedule's last step.
    how: how the run ended, "plateau" or "budget" (as ``schedules.ended``); None while
      it runs. A run restored at its end takes no step.
    batches: the training batches from the one after ``step``'s; their
      position is saved in every checkpoint.
    train_step: ``make_train_step``'s jitted step.
    lr: the learning-rate schedule (logged at every logging step).
    ckpts: the run's checkpoints.
    writer: the run's metric writer.
    plateau: the state of the stopping rule; None for a run without it.
    meta: what every checkpoint's meta records besides the step, the data
      position and the stopping rule's state.
    start: the step the loop started from.
    last_saved: the step of the newest checkpoint.
    final: the newest test evaluation (None before the first).
    progress: the progress meter of the logging lines.
  """
  run: runs.Run
  config: ml_collections.ConfigDict
  model: models.Model
  mesh: jax.sharding.Mesh
  state: dict[str, Any]
  step: int
  num_steps: int
  how: str | None
  batches: Any
  train_step: Callable
  lr: optax.Schedule
  ckpts: checkpoints.RunCheckpoints
  writer: metric_writers.MetricWriter
  plateau: schedules.Plateau | None
  meta: dict[str, Any]
  start: int = dataclasses.field(init=False)
  last_saved: int = dataclasses.field(init=False)
  final: dict[str, float] | None = dataclasses.field(init=False, default=None)
  progress: metric_writers.Progress = dataclasses.field(init=False)

  def __post_init__(self):
    self.start = self.last_saved = self.step
    self.progress = metric_writers.Progress(self.num_steps)

  def run_to_end(self) -> dict[str, float]:
    """Trains chunk by chunk until the run ends; returns the test evaluation at its end."""
    while self.how is None:
      metrics = self.train_chunk()
      due = self.due(self.step)
      self.check_finite(metrics)
      if "log" in due:
        self.log(metrics)
      self.decide_end(due)
      if "evaluate" in due or self.how is not None:
        self.evaluate()
      if "save" in due or self.how is not None:
        self.save()
    if self.final is None:  # Complete on disk, but its final evaluation was lost.
      self.evaluate(report=False)
    return self.final

  def intervals(self) -> dict[str, int]:
    """Steps between the things that fall due: {"log", "evaluate", "save"} from
    ``config.train``, and "validate" under the stopping rule."""
    t = self.config.train
    every = {"log": t.log_every, "evaluate": t.eval_every, "save": t.checkpoint_every}
    if self.plateau is not None:
      every["validate"] = self.plateau.rule.validate_every
    return every

  def due(self, step: int) -> set[str]:
    """What falls due at ``step``: each name of ``intervals`` whose interval divides it, and
    all of them at the budget's last step."""
    return {name for name, every in self.intervals().items()
            if step % every == 0 or step == self.num_steps}

  def chunk_end(self) -> int:
    """The first step after ``step`` at which anything falls due (``due``)."""
    return min([self.num_steps] + [(self.step // every + 1) * every
                                   for every in self.intervals().values()])

  def train_chunk(self) -> list[dict[str, np.ndarray]]:
    """Takes the steps up to ``chunk_end`` and returns their {"loss", "accuracy"}, on the
    host. The progress meter starts after the loop's first step (its compilation)."""
    end, metrics = self.chunk_end(), []
    for step in range(self.step + 1, end + 1):
      self.state, m = self.train_step(self.state,
                                      inputs.shard_batch(next(self.batches), self.mesh))
      metrics.append(m)
      if step == self.start + 1:  # The ETA counts from here, after compilation.
        jax.block_until_ready(m)
        self.progress.begin(step)
    self.step = end
    return inputs.to_host(metrics)

  def check_finite(self, metrics: list[dict[str, np.ndarray]]) -> None:
    """Raises FloatingPointError at the first non-finite loss of the chunk ``metrics``,
    naming the newest checkpoint, which is kept."""
    bad = _first_nonfinite(range(self.step - len(metrics) + 1, self.step + 1), metrics)
    if bad:
      raise FloatingPointError(
          f"{self.run.name}: the training loss is {bad[1]} at step {bad[0]}; training stopped. "
          f"The last good checkpoint (step {self.last_saved}) is kept in "
          f"{self.ckpts.directory}.")

  def log(self, metrics: list[dict[str, np.ndarray]]) -> None:
    """Writes and logs the chunk's mean training loss and accuracy, and the learning rate."""
    means = {k: float(np.mean([m[k] for m in metrics])) for k in ("loss", "accuracy")}
    self.writer.write_scalars(self.step, {"train/loss": means["loss"],
                                          "train/accuracy": means["accuracy"],
                                          "train/learning_rate": float(self.lr(self.step - 1))})
    log.info("%s %s", self.run.name, self.progress.line(self.step, means))

  def decide_end(self, due: set[str]) -> None:
    """Sets ``how`` if the run ends at this step: validates when due and stops at a
    plateau (``schedules.Plateau.observe``); at the budget's last step it ends anyway."""
    last = self.step == self.num_steps
    if "validate" not in due:
      self.how = "budget" if last else None
      return
    valid = evaluation.evaluate(self.model, self.state["params"],
                                inputs.validation_batches(self.config, self.run.dataset),
                                mesh=self.mesh)
    self.writer.write_scalars(self.step, {f"validation/{k}": v for k, v in valid.items()})
    plateau = self.plateau
    stop = plateau.observe(self.step, valid["loss"])
    self.how = "plateau" if stop else "budget" if last else None
    log.info("%s step %d validation loss %.4f (best %.4f at step %d)", self.run.name, self.step,
             valid["loss"], plateau.best_loss, plateau.best_step)
    if stop:
      log.info("%s: no improvement of the validation loss by more than %g relative in %d "
               "evaluations; stopped at step %d of %d", self.run.name, plateau.rule.min_delta,
               plateau.rule.patience, self.step, self.num_steps)

  def evaluate(self, report: bool = True) -> None:
    """Sets ``final`` to the loss and accuracy on the test split (reported, never used for a
    decision) of the current parameters; writes and logs them if ``report``."""
    self.final = evaluation.evaluate(self.model, self.state["params"],
                                     inputs.eval_batches(self.config, self.run.dataset),
                                     mesh=self.mesh)
    if report:
      self.writer.write_scalars(self.step, {f"eval/{k}": v for k, v in self.final.items()})
      log.info("%s step %d eval %s", self.run.name, self.step,
               " ".join(f"{k} {v:.4f}" for k, v in self.final.items()))

  def save(self) -> None:
    """Saves a checkpoint of this step: parameters, optimiser state, data position, the
    stopping rule's state and, at the end, how the run ended."""
    extra = {} if self.plateau is None else {"stopping": self.plateau.to_meta()}
    if self.how is not None:
      extra["stopped"] = self.how
    self.ckpts.save(self.step, self.state["params"], self.state["opt_state"],
                    {**self.meta, **extra, "step": self.step,
                     "data_state": self.batches.get_state()})
    self.last_saved = self.step
