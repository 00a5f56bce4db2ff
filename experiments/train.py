"""Training: the base model, then every re-initialised seed (docs/lmc.md, 'Re-initialisation').

``train_and_evaluate(config, workdir)`` checks the config and the workdir,
then trains, in order, the runs that ``runs(config)`` lists. Each run keeps in
``fingerprint.json`` the config fields and inputs it depends on
(``run_fields``; ``fingerprints.py`` says which and why): a run whose fields
are unchanged is skipped when complete and resumed from its newest intact
checkpoint when not; one whose fields changed is moved aside to
``<run dir>.stale-<time>`` (never deleted) and trained again, with one log
line naming the fields. A fine-tuned run depends on the base model's final
parameters, so a retrained base retrains it too. A complete run's final
parameters are verified (``checkpoints.py``) before it is skipped. Layout:

    workdir/base/                       the base model: seed ``config.seed``,
                                        data set ``config.dataset.name`` (not
                                        trained when every scope is "full":
                                        nothing starts from it)
    workdir/reinit/<scope>/seed_<s>/    the base model with ``scope``
                                        re-initialised from seed s and
                                        fine-tuned (trained from scratch for
                                        the "full" scope), on
                                        ``config.reinit.dataset`` if set

and in every run directory ``checkpoints/<step>/`` (``checkpoints.py``),
``metrics.jsonl`` and TensorBoard event files (``metric_writers.py``),
``fingerprint.json``, and ``final_metrics.json`` (the test evaluation of the
last step, how many steps the run took and why it stopped; written
atomically). Checkpoints are verified on restore
(``checkpoints.py``): a damaged one is moved to ``corrupt_checkpoints/`` and
training falls back to the newest intact one, saying so. ``load_checkpoints``
gives the study every run's final parameters and ``steps_taken`` how each run
ended; ``inputs.py`` (model, batches, mesh) and ``evaluation.py``
(``batch_metrics``, ``evaluate``) the pieces it needs to evaluate them.

Stopping rule (``Stopping``; ``config.reinit.patience`` > 0). A re-initialised
run, fine-tuned or ("full") trained from scratch, and with
``config.reinit.stop_base`` the base model, is trained until its
validation loss stops improving or its step budget runs out, whichever comes
first, so that the endpoints the study compares are converged. Every
``validate_every`` steps, and at the budget's last step, the run computes its
loss on ``config.dataset.validation_split``, a held-out slice of the training
data (``config.dataset.train_split`` gives the rest): an evaluation improves
if it is below (1 - ``min_delta``) times the best so far; after ``patience``
evaluations in a row without improvement the run stops there. Its result is
the parameters at the stop: a state of the trajectory, saved with its
optimiser state like any checkpoint, at most ``patience`` evaluations past
the best one (keeping the best iterate instead would need a second copy of
the parameters in every checkpoint). The budget is the schedule's
``num_steps`` (``config.reinit`` when fine-tuning, ``config.train`` for
"full"), and the learning rate follows its warmup and cosine decay over the
budget whether or not the run stops early. The base model trains its full
schedule unless ``config.reinit.stop_base`` is set, when it follows the same
rule with ``config.train.num_steps`` as its budget: an endpoint that the study
compares only through the runs fine-tuned from it, which are converged from
a converged start. ``config_checks`` refuses a rule that can never stop a
run: the first stop it can make is at (patience + 1) x validate_every steps
(the first validation sets the best loss, then patience more find no
improvement), which has to fall within every budget it governs.
The test split is read only for the evaluations that are reported: no
decision reads it.

A run is complete when its newest checkpoint is at the last step of its
schedule or records a stop (meta "stopped": "plateau" or "budget"; every run
records it at its end). The plateau state (best loss, its step, evaluations
since) is saved in every checkpoint's meta, so that a resumed run makes the
decisions an uninterrupted one makes, bit for bit.

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

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np
import optax

from attn_symmetry import models
from attn_symmetry import spec as spec_lib
from experiments import atomic_io
from experiments import checkpoints
from experiments import config_checks
from experiments import fingerprints
from experiments import inputs
from experiments import metric_writers
from experiments import processes
from experiments import reinit
from experiments import evaluation

Params = dict[str, Any]

# Progress and results; main.py quiets the INFO chatter of other libraries (orbax) but not this.
log = logging.getLogger(__name__)
log.setLevel(logging.INFO)


@dataclasses.dataclass(frozen=True)
class Run:
  """One training run of a setting.

  Attributes:
    name: "base" or "reinit/<scope>/seed_<seed>", also its directory under
      the workdir.
    scope: None for the base model, else the re-initialised scope.
    seed: initialisation and data-order seed.
    dataset: the data set it trains and is evaluated on.
  """
  name: str
  scope: str | None
  seed: int
  dataset: str

  @property
  def fine_tunes(self) -> bool:
    """Whether the run starts from the base model (every scope but "full")."""
    return self.scope not in (None, "full")


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Length and learning rate of a run (the rest comes from ``config.train``)."""
  num_steps: int
  learning_rate: float
  warmup_steps: int


@dataclasses.dataclass(frozen=True)
class Stopping:
  """The stopping rule of a run (the module docstring; ``config.reinit``).

  Attributes:
    patience: validation evaluations in a row without improvement after which
      the run stops.
    min_delta: an evaluation improves if its loss is below (1 - min_delta)
      times the best so far (relative; losses are cross-entropies, >= 0).
    validate_every: steps between validation evaluations.
  """
  patience: int
  min_delta: float
  validate_every: int


def stopping(config: ml_collections.ConfigDict, run: Run) -> Stopping | None:
  """The rule that ``run`` follows: every re-initialised run (the "full" scope too) when
  ``config.reinit.patience`` > 0, and the base model when ``config.reinit.stop_base`` is set
  too; None when the rule is off, or for the base model without ``stop_base``."""
  r = config.reinit
  if not r.patience or (run.scope is None and not r.stop_base):
    return None
  return Stopping(r.patience, r.min_delta, r.validate_every)


@dataclasses.dataclass
class Plateau:
  """The state of a run's stopping rule, saved in every checkpoint's meta.

  Attributes:
    rule: the rule.
    best_loss: the lowest validation loss so far (None before the first).
    best_step: its step.
    since_best: evaluations since the best (without improvement).
    validation_loss: the latest validation loss.
  """
  rule: Stopping
  best_loss: float | None = None
  best_step: int = 0
  since_best: int = 0
  validation_loss: float | None = None

  def observe(self, step: int, loss: float) -> bool:
    """Records the validation ``loss`` at ``step``; True when the run has to stop."""
    self.validation_loss = loss
    if self.best_loss is None or loss < self.best_loss * (1 - self.rule.min_delta):
      self.best_loss, self.best_step, self.since_best = loss, step, 0
    else:
      self.since_best += 1
    return self.since_best >= self.rule.patience

  def to_meta(self) -> dict[str, Any]:
    return {"best_loss": self.best_loss, "best_step": self.best_step,
            "since_best": self.since_best, "validation_loss": self.validation_loss}

  @classmethod
  def from_meta(cls, rule: Stopping, meta: dict[str, Any] | None) -> "Plateau":
    """The state saved by ``to_meta`` (a fresh one for None)."""
    return cls(rule, **(meta or {}))

  def record(self) -> dict[str, Any]:
    """What ``final_metrics.json`` and ``steps_taken`` report of it."""
    return {"validation_loss": self.validation_loss, "best_validation_loss": self.best_loss,
            "best_step": self.best_step}


_STOPS = {"plateau": "stopped at a validation plateau", "budget": "at the end of its budget"}


def ended(meta: dict[str, Any], step: int, num_steps: int) -> str | None:
  """How a run whose newest checkpoint is ``step`` (with ``meta``) ended: "plateau" or
  "budget", or None if it is unfinished. Checkpoints from before stops were recorded end
  at ``num_steps``."""
  if meta.get("stopped"):
    return meta["stopped"]
  return "budget" if step >= num_steps else None


def runs(config: ml_collections.ConfigDict) -> list[Run]:
  """The base run, then every (scope, seed) of ``config.reinit``, in training order.

  The base run is left out when every scope is "full": no run starts from it, and
  the study never reads it (it trains only when a scope fine-tunes it, or when
  there are no scopes and it is the only run)."""
  transfer = config.reinit.dataset or config.dataset.name
  reinit = [Run(f"reinit/{scope}/seed_{s}", scope, s, transfer)
            for scope in config.reinit.scopes for s in config.reinit.seeds]
  base = Run("base", None, config.seed, config.dataset.name)
  return ([base] if not reinit or any(r.fine_tunes for r in reinit) else []) + reinit


def run_dir(workdir: str, run: Run) -> str:
  """The directory of ``run``: workdir/base or workdir/reinit/<scope>/seed_<s>."""
  return os.path.join(workdir, *run.name.split("/"))


def schedule(config: ml_collections.ConfigDict, run: Run) -> Schedule:
  """``config.reinit``'s schedule when fine-tuning a scope, else ``config.train``'s."""
  if run.fine_tunes:
    r = config.reinit
    return Schedule(r.num_steps, r.learning_rate, r.warmup_steps)
  t = config.train
  return Schedule(t.num_steps, t.learning_rate, t.warmup_steps)


def run_fields(config: ml_collections.ConfigDict, run: Run, base_params: str | None = None
               ) -> dict[str, Any]:
  """The config fields and inputs that ``run``'s result depends on (``fingerprints.py``).

  Args:
    config: the setting.
    run: one of ``runs(config)``.
    base_params: the content hash of the base model's final parameters;
      needed for a run that fine-tunes it.

  Returns:
    a flat JSON-able dict such as {"train.learning_rate": 0.003, ...,
    "sha256 of base params": "<hex>"}.
  """
  names = fingerprints.TRAINING + (
      fingerprints.REINIT_SCHEDULE if run.fine_tunes else fingerprints.TRAIN_SCHEDULE)
  if stopping(config, run) is not None:
    names += fingerprints.STOPPING
  fields = {"run": run.name, **fingerprints.config_fields(config, names)}
  if run.scope is None:
    fields.update({"seed": run.seed, "dataset.name": run.dataset})
  else:
    fields.update({"reinit.scope": run.scope, "reinit.seed": run.seed,
                   "reinit.dataset": run.dataset})
  if run.fine_tunes:
    if base_params is None:
      raise ValueError(f"{run.name} fine-tunes the base model: its fields need the base params hash")
    fields[fingerprints.INPUT + "base params"] = base_params
  return fields


def create_optimizer(config: ml_collections.ConfigDict, sched: Schedule, trainable: Params
                     ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW with warmup and cosine decay on the trainable leaves; zero updates elsewhere.

  Weight decay applies to matrices (kernels, embeddings), not to biases and
  norm scales. Frozen leaves (``trainable`` False) get ``optax.set_to_zero``
  through ``optax.multi_transform`` and keep no optimiser state.

  Returns:
    (optimizer, learning-rate schedule).
  """
  t = config.train
  lr = optax.warmup_cosine_decay_schedule(
      0.0, sched.learning_rate, sched.warmup_steps, sched.num_steps,
      end_value=sched.learning_rate * t.final_lr_fraction)
  decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
  adamw = optax.chain(optax.clip_by_global_norm(t.grad_clip_norm),
                      optax.adamw(lr, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay,
                                  mask=decay_mask))
  labels = jax.tree.map(lambda m: "train" if m else "freeze", trainable)
  return optax.multi_transform({"train": adamw, "freeze": optax.set_to_zero()}, labels), lr


def make_train_step(model: models.Model, optimizer: optax.GradientTransformation,
                    trainable: Params, mesh: jax.sharding.Mesh, param_sharding: str = "replicated"):
  """Jitted ``step(state, batch) -> (state, {"loss", "accuracy"})``.

  ``state`` is {"params", "opt_state"}, placed by ``inputs.placement(mesh,
  param_sharding)`` and donated; the step returns it placed the same way and the
  metrics replicated. Frozen leaves are passed through as they are (not even
  ``p + 0``), so they stay bit-identical.
  """

  def loss_fn(params, batch):
    sums = evaluation.batch_metrics(model, params, batch)
    return sums["loss"] / sums["count"], sums

  def step(state, batch):
    (loss, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = jax.tree.map(lambda p, u, m: optax.apply_updates(p, u) if m else p,
                          state["params"], updates, trainable)
    return ({"params": params, "opt_state": opt_state},
            {"loss": loss, "accuracy": sums["correct"] / sums["count"]})

  replicated = inputs.replicated(mesh)
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  state = jax.eval_shape(lambda p: {"params": p, "opt_state": optimizer.init(p)}, shapes)
  placed = inputs.shardings(state, inputs.placement(mesh, param_sharding))
  return jax.jit(step, donate_argnums=0, out_shardings=(placed, replicated))


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
  data set the study reads must have ``config.study.eval_split``. Every process must read
  an equal share of each batch (``inputs.check_processes``).
  """
  datasets = {config.dataset.name}
  if config.reinit.scopes:
    datasets.add(config.reinit.dataset or config.dataset.name)
  inputs.check_processes(config)
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


def _first_nonfinite(steps: list[int], metrics: list[dict[str, np.ndarray]]):
  """(step, loss) of the first non-finite training loss, or None.

  The run stops there, keeping its last good checkpoint (``_RunLoop.check_finite``), rather
  than skipping the step as ``optax.apply_if_finite`` would: a skipped step
  leaves a run that no longer follows its schedule and data order, which the
  study's reruns and resumes rely on to reproduce it bit for bit.
  """
  for step, m in zip(steps, metrics):
    if not np.isfinite(m["loss"]):
      return step, m["loss"]
  return None


_TRAIN_STEPS: dict[Any, tuple] = {}


def _optimizer_and_step(config, model, sched, trainable, mesh):
  """(optimizer, jitted learning-rate schedule, jitted step), cached in this process.

  Runs with the same model, schedule, optimiser settings and trainable set
  (the seeds of a scope; the base model and the "full" scope) share one
  compilation.
  """
  t = config.train
  key = (model.config, sched, tuple(sorted(spec_lib.flatten(trainable).items())), mesh,
         t.param_sharding, t.final_lr_fraction, t.grad_clip_norm, t.b1, t.b2, t.weight_decay)
  if key not in _TRAIN_STEPS:
    optimizer, lr = create_optimizer(config, sched, trainable)
    _TRAIN_STEPS[key] = (optimizer, jax.jit(lr),
                         make_train_step(model, optimizer, trainable, mesh, t.param_sharding))
  return _TRAIN_STEPS[key]


@dataclasses.dataclass
class _RunLoop:
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
    how: how the run ended, "plateau" or "budget" (as ``ended``); None while
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
  run: Run
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
  plateau: Plateau | None
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
    plateau (``Plateau.observe``); at the budget's last step it ends anyway."""
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
    ckpts = checkpoints.RunCheckpoints(run_dir(self.workdir, runs(self.config)[0]),
                                       read_only=True)
    try:
      return ckpts.digest(ckpts.latest_step())
    finally:
      ckpts.close()

  def fields(self, run: Run) -> dict[str, Any]:
    """``run_fields`` of ``run``; a fine-tuned run's need the base model trained."""
    return run_fields(self.config, run, self._base_digest() if run.fine_tunes else None)

  def _check_fingerprint(self, run: Run, directory: str, fields: dict[str, Any]) -> None:
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

  def _newest_intact(self, run: Run, ckpts: checkpoints.RunCheckpoints, restore):
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

  def _initial_params(self, run: Run):
    """(params, trainable mask, host copy of the base params or None) before training."""
    fresh = self._fresh(run.seed)
    if not run.fine_tunes:
      return fresh, jax.tree.map(lambda _: True, fresh), None
    if self._base is None:
      base_ckpts = checkpoints.RunCheckpoints(run_dir(self.workdir, runs(self.config)[0]),
                                              read_only=True)
      # A host copy: device arrays given to the training step are donated.
      self._base = inputs.to_host(base_ckpts.restore_params(
          base_ckpts.latest_step(), checkpoints.abstract_like(fresh, self._place)))
      base_ckpts.close()
    trainable = reinit.trainable_mask(self._base, reinit.scope_paths(self.model, run.scope))
    base = jax.device_put(self._base, inputs.shardings(self._base, self._place))
    if run.scope == reinit.SPAWN:  # a child of the base model: nothing re-initialised
      return base, trainable, self._base
    return reinit.reinitialise(base, fresh, trainable), trainable, self._base

  def train(self, run: Run) -> dict[str, Any]:
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
    directory = run_dir(self.workdir, run)
    self._check_fingerprint(run, directory, self.fields(run))
    ckpts = checkpoints.RunCheckpoints(directory, keep=self.config.train.keep_checkpoints)
    try:
      return self._train(run, directory, ckpts)
    finally:
      ckpts.close()

  def _train(self, run: Run, directory: str, ckpts: checkpoints.RunCheckpoints
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

  def _result_if_complete(self, run: Run, ckpts: checkpoints.RunCheckpoints, final_path: str
                          ) -> dict[str, Any] | None:
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
    how = ended(intact[1][1], latest, schedule(self.config, run).num_steps)
    if how is None:
      return None
    log.info("%s: complete (step %d, %s), skipped", run.name, latest, _STOPS[how])
    return saved

  def _start_loop(self, run: Run, directory: str, ckpts: checkpoints.RunCheckpoints,
                  params: Params, trainable: Params) -> _RunLoop:
    """The training loop of ``run`` from ``params`` (step 0), or from its newest intact
    checkpoint: parameters, optimiser state, data position and stopping-rule state."""
    sched = schedule(self.config, run)
    optimizer, lr, train_step = _optimizer_and_step(self.config, self.model, sched, trainable,
                                                    self.mesh)
    state = {"params": params, "opt_state": optimizer.init(params)}
    batches = inputs.train_batches(self.config, run.dataset, seed=run.seed)
    abstract = checkpoints.abstract_like(state, self._place)
    intact = self._newest_intact(
        run, ckpts, lambda s: ckpts.restore(s, abstract["params"], abstract["opt_state"]))
    start, meta = 0, {}
    if intact is not None:
      start, (state["params"], state["opt_state"], meta) = intact
      batches.set_state(meta["data_state"])
      if ended(meta, start, sched.num_steps) is None:
        log.info("%s: resuming from step %d in %s", run.name, start, ckpts.directory)
    else:
      state = jax.device_put(state, inputs.shardings(state, self._place))
    rule = stopping(self.config, run)
    plateau = None if rule is None else Plateau.from_meta(rule, meta.get("stopping"))
    arch = checkpoints.architecture(self.model.config.family, jax.eval_shape(lambda: params))
    writer = metric_writers.MetricWriter(directory, resume_step=start,
                                         enabled=jax.process_index() == 0)
    return _RunLoop(run=run, config=self.config, model=self.model, mesh=self.mesh, state=state,
                    step=start, num_steps=sched.num_steps,
                    how=ended(meta, start, sched.num_steps), batches=batches,
                    train_step=train_step, lr=lr, ckpts=ckpts, writer=writer, plateau=plateau,
                    meta={"run": run.name, "architecture": arch})


def check_workdir(config: ml_collections.ConfigDict, model: models.Model, workdir: str) -> None:
  """Raises ValueError if any run directory holds checkpoints of another architecture."""
  arch = checkpoints.architecture(model.config.family,
                                  jax.eval_shape(model.init, jax.random.key(0)))
  for run in runs(config):
    checkpoints.check_architecture(run_dir(workdir, run), arch)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, dict]:
  """Trains the base model and every re-initialised seed; returns final evaluations by run.

  Everything that can be checked is checked before the first step: the
  config (``config_checks.validate``), the model it builds, a transfer data set,
  and the checkpoints already in ``workdir``.
  """
  config_checks.validate(config)
  check_data(config)
  model = inputs.create_model(config)
  check_workdir(config, model, workdir)
  trainer = Trainer(config, model, workdir)
  log.info("training %d run(s) in %s on %d device(s)%s", len(runs(config)), workdir,
           jax.device_count(), ", parameters and optimiser state split over them (fsdp)"
           if config.train.param_sharding == "fsdp" else "")
  results = {run.name: trainer.train(run) for run in runs(config)}
  width = max(map(len, results))
  log.info("final evaluation:\n%s", "\n".join(
      f"  {name:<{width}}  loss {m['loss']:.4f}  accuracy {m['accuracy']:.4f}"
      for name, m in results.items()))
  return results


def load_checkpoints(config: ml_collections.ConfigDict, workdir: str, *,
                     require_complete: bool = False, on_host: bool = False
                     ) -> dict[str, Params]:
  """The parameters of the latest checkpoint of every run of ``config``, by run name.

  Names are those of ``runs(config)``: "base", "reinit/<scope>/seed_<s>".
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
  for run in runs(config):
    directory = run_dir(workdir, run)
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
  fields = run_fields(config, run, base_digest if run.fine_tunes else None)
  old = fingerprints.read_record(directory)
  if old is None:
    raise ValueError(f"run {run.name!r} in {directory} has no readable {fingerprints.RECORD} "
                     "(trained before runs recorded their config); rerun training, which "
                     "moves it aside and trains it again")
  if old != fields:
    raise ValueError(f"run {run.name!r} in {directory} was trained with other fields: "
                     f"{fingerprints.change_line(old, fields)}; rerun training first")
  num_steps = schedule(config, run).num_steps
  if require_complete and ended(ckpts.restore_meta(step), step, num_steps) is None:
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
  for run in runs(config):
    ckpts = checkpoints.RunCheckpoints(run_dir(workdir, run), read_only=True)
    try:
      step = ckpts.latest_step()
      if step is None:
        raise ValueError(f"run {run.name!r} has no checkpoint in {ckpts.directory}; "
                         "train it first")
      meta = ckpts.restore_meta(step)
    finally:
      ckpts.close()
    num_steps = schedule(config, run).num_steps
    out[run.name] = {"steps": step, "stopped": ended(meta, step, num_steps),
                     "num_steps": num_steps}
    rule = stopping(config, run)
    if rule is not None:
      out[run.name].update(Plateau.from_meta(rule, meta.get("stopping")).record())
  return out
