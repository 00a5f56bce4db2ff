"""A run's schedule and its stopping rule (docs/lmc.md, 'Re-initialisation').

``Schedule``: the length and learning rate of a run; ``Stopping``: the rule
that stops it early, ``Plateau`` the rule's state, ``ended`` how a run ended.
Which run follows which is ``runs.schedule`` and ``runs.stopping``.

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
"""

from __future__ import annotations

import dataclasses
from typing import Any


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


STOPS = {"plateau": "stopped at a validation plateau", "budget": "at the end of its budget"}


def ended(meta: dict[str, Any], step: int, num_steps: int) -> str | None:
  """How a run whose newest checkpoint is ``step`` (with ``meta``) ended: "plateau" or
  "budget", or None if it is unfinished. Checkpoints from before stops were recorded end
  at ``num_steps``."""
  if meta.get("stopped"):
    return meta["stopped"]
  return "budget" if step >= num_steps else None
