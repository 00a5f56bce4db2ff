"""The runs of a setting: which runs train, where, on which schedule, and what each depends on.

``runs(config)`` lists the base model, then every (scope, seed) of
``config.reinit``, in training order; ``schedule`` and ``stopping`` give a
run's schedule and its stopping rule (``schedules.py``); ``run_dir`` places
each in the workdir:

    workdir/base/                       the base model: seed ``config.seed``,
                                        data set ``config.dataset.name`` (not
                                        trained when every scope is "full":
                                        nothing starts from it)
    workdir/reinit/<scope>/seed_<s>/    the base model with ``scope``
                                        re-initialised from seed s and
                                        fine-tuned (trained from scratch for
                                        the "full" scope), on
                                        ``config.reinit.dataset`` if set

Each run keeps in ``fingerprint.json`` the config fields and inputs it depends
on (``run_fields``; ``experiments/setting/fingerprints.py`` says which and why).
A fine-tuned run depends on the base model's final parameters, so a retrained
base retrains it too.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import ml_collections

from experiments.setting import fingerprints
from experiments.train import schedules


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


def schedule(config: ml_collections.ConfigDict, run: Run) -> schedules.Schedule:
  """``config.reinit``'s schedule when fine-tuning a scope, else ``config.train``'s."""
  if run.fine_tunes:
    r = config.reinit
    return schedules.Schedule(r.num_steps, r.learning_rate, r.warmup_steps)
  t = config.train
  return schedules.Schedule(t.num_steps, t.learning_rate, t.warmup_steps)


def stopping(config: ml_collections.ConfigDict, run: Run) -> schedules.Stopping | None:
  """The rule that ``run`` follows: every re-initialised run (the "full" scope too) when
  ``config.reinit.patience`` > 0, and the base model when ``config.reinit.stop_base`` is set
  too; None when the rule is off, or for the base model without ``stop_base``."""
  r = config.reinit
  if not r.patience or (run.scope is None and not r.stop_base):
    return None
  return schedules.Stopping(r.patience, r.min_delta, r.validate_every)


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
