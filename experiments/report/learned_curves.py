"""The learned method's held-out barrier against its training steps, one pair per row.

The learned alignment (``attn_symmetry/matching/_learned.py``) evaluates its iterate on
held-out batches of the training split at the start, every ``eval_every`` steps and at the
end, and keeps every evaluation's (step, held-out barrier) in its info: a scope's
``results.json`` holds it per pair under
``pairs[i]["methods"]["learned"]["matching"]["learned"]["curve"]``, beside "steps" (taken),
"best_step" (the returned iterate's), "stopped" (whether patience ended it before the budget),
"patience" and "schedule". The held-out barrier is the largest gap between the interpolated
model's loss (the training loss: cross-entropy in nats, at lambda 1/2, or 1/4, 1/2 and 3/4
with uniform lambda) and the chord between the endpoints' losses, 0 when the path lies below
the chord; it is not the study's test-split barrier.

For every committed run (``committed.runs``; not the reduced reruns nor the runs on every
core) and every scope whose learned pairs hold a curve, one row (``Row``) from the first pair
in ``results.json``'s order that holds one: the steps taken and the budget (the run's
``config.json``: ``study.learn_steps``), the best step, how the training ended, and the
held-out barrier at the start, at the best step and at the end. Whether the curve has
flattened is read off one number, the relative change over the curve's last quarter
(``last_quarter_change``): with s_0 and s_n the first and last evaluations' steps and b(s)
the held-out barrier of the evaluation at step s,

    change = 100 (b(s_n) - b(s_q)) / b(s_q)   (in %),

s_q the step of the last evaluation at or before s_0 + 3/4 (s_n - s_0): near 0 where the last
quarter of the steps left the barrier where it was, negative where it was still falling.
None (n/a) when b(s_q) is 0 or s_q is the last evaluation.

Scopes of the learned method whose pairs hold no curve (runs stored before the curve was
saved) are named in one note under the table. ``table`` writes the markdown (the block of
``results/README.md`` that ``results_table.write`` fills); ``plot`` draws one panel per row
(``python experiments/reproduce.py --table`` writes ``results/learned_curves.png`` with the
README, when a committed run holds a curve; ``python -m experiments.report.learned_curves``
writes the figure alone).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

from matplotlib import figure

from experiments.report import committed
from experiments.workdir import atomic_io

METHOD = "learned"
FIGURE = "learned_curves.png"  # under results/, written by ``python -m ...learned_curves``
NO_CURVE = "no curve recorded: runs before the curve was saved"
PANEL_COLUMNS = 4


class Row(NamedTuple):
  """One pair's held-out barrier against the steps of the learned method (module docstring).

  Attributes:
    setting, scope: where it was measured.
    pair: "<a>-<b>", the seeds of the pair (the first of the scope that holds a curve).
    curve: (step, held-out barrier) of every evaluation, the start's first.
    steps: the steps taken.
    budget: the configured step budget (``study.learn_steps``), None when not in the config.
    best_step: the step of the returned iterate (0: the start).
    stopped: how the training ended: "patience (p)", "budget", "batches ran out", or
      "not recorded" (runs before "stopped" was saved).
    schedule: the learning-rate schedule, "not recorded" when missing.
    start, best, end: the held-out barrier at step 0, at ``best_step`` and at the last
      evaluation.
    last_quarter: ``last_quarter_change`` of ``curve`` in %, or None.
  """
  setting: str
  scope: str
  pair: str
  curve: list[tuple[int, float]]
  steps: int
  budget: int | None
  best_step: int
  stopped: str
  schedule: str
  start: float
  best: float
  end: float
  last_quarter: float | None


def last_quarter_change(curve: Sequence[Sequence[float]]) -> float | None:
  """The relative change of the held-out barrier over the last quarter of ``curve``'s steps,
  in %: 100 (b_end - b_q) / b_q, b_q the barrier of the last evaluation at or before
  s_0 + 3/4 (s_end - s_0) (module docstring); None when b_q is 0 or is the last evaluation."""
  if len(curve) < 2:
    return None
  first, last = curve[0][0], curve[-1][0]
  cut = first + 0.75 * (last - first)
  at = max(i for i, (step, _) in enumerate(curve) if step <= cut)
  b_q, b_end = curve[at][1], curve[-1][1]
  if at == len(curve) - 1 or b_q == 0:
    return None
  return 100.0 * (b_end - b_q) / b_q


def _stopped(info: dict[str, Any], budget: int | None) -> str:
  """How the training of ``info`` (info["learned"]) ended (``Row.stopped``)."""
  if "stopped" not in info:
    return "not recorded"
  if info["stopped"]:
    return f"patience ({info.get('patience', '?')})"
  if budget is None or info["steps"] >= budget:
    return "budget"
  return "batches ran out"


def _row(setting: str, scope: str, pair: dict[str, Any], budget: int | None) -> Row:
  """The ``Row`` of ``pair``, whose learned info holds a curve."""
  info = pair["methods"][METHOD]["matching"]["learned"]
  curve = [(int(step), float(barrier)) for step, barrier in info["curve"]]
  at_best = [b for step, b in curve if step == info["best_step"]]
  best = at_best[0] if at_best else info["holdout"]["best"]["barrier"]
  return Row(setting, scope, f"{pair['a']}-{pair['b']}", curve, info["steps"], budget,
             info["best_step"], _stopped(info, budget), info.get("schedule", "not recorded"),
             curve[0][1], best, curve[-1][1], last_quarter_change(curve))


def _learned_info(pair: dict[str, Any]) -> dict[str, Any] | None:
  return pair["methods"].get(METHOD, {}).get("matching", {}).get("learned")


def rows(results_root: str) -> tuple[list[Row], list[str]]:
  """(a ``Row`` per committed run and scope whose learned pairs hold a curve, by setting and
  then in the config's order of scopes; "<setting>/<scope>" of each scope of the learned
  method that holds none)."""
  out, left_out = [], []
  for run in committed.runs(results_root):
    budget = run.config().get("study", {}).get("learn_steps")
    for scope in run.scopes():
      if not run.has(scope):
        continue
      pairs = [p for p in run.results(scope)["pairs"] if _learned_info(p) is not None]
      with_curve = [p for p in pairs if _learned_info(p).get("curve")]
      if with_curve:
        out.append(_row(run.setting, scope, with_curve[0], budget))
      elif pairs:
        left_out.append(f"{run.setting}/{scope}")
  return out, left_out


def _cells(r: Row) -> str:
  change = "n/a" if r.last_quarter is None else f"{r.last_quarter:+.1f} %"
  budget = "n/a" if r.budget is None else f"{r.budget:,}"
  return (f"| {r.setting} | {r.scope} | {r.pair} | {r.steps:,} | {budget} | {r.schedule} | "
          f"{r.best_step:,} | {r.stopped} | {r.start:.4f} | {r.best:.4f} | {r.end:.4f} | "
          f"{change} |")


def table(results_root: str) -> str:
  """Markdown: one line per ``Row`` (module docstring), the figure's link, then the scopes
  left out in one note."""
  found, left_out = rows(results_root)
  note = f"Left out ({NO_CURVE}): " + ", ".join(left_out) + "." if left_out else ""
  if not found:
    return "No committed run of the learned method holds a curve yet." + (
        f" {note}" if note else "")
  lines = ["| setting | scope | pair | steps taken | budget (`learn_steps`) | schedule | "
           "best step | ended by | held-out barrier at the start (nats) | at the best step | "
           "at the end | change over the last quarter |", "|" + "---|" * 12]
  lines += [_cells(r) for r in found]
  lines += ["", f"Figure: [{FIGURE}]({FIGURE})."]
  return "\n".join(lines + (["", note] if note else []))


def plot(results_root: str, path: str) -> str | None:
  """PNG with one panel per ``Row``: the held-out barrier against the step (the y axis from 0,
  the x axis to the budget), the best step marked; None (nothing written) when no committed
  run holds a curve."""
  found, _ = rows(results_root)
  if not found:
    return None
  columns = min(PANEL_COLUMNS, len(found))
  lines = math.ceil(len(found) / columns)
  fig = figure.Figure(figsize=(3.2 * columns, 2.4 * lines))
  axes = fig.subplots(lines, columns, squeeze=False).ravel()
  for ax, r in zip(axes, found):
    steps, barriers = zip(*r.curve)
    ax.plot(steps, barriers, ".-", color="tab:red", lw=1, ms=3)
    ax.plot([r.best_step], [r.best], "o", mfc="none", color="black", ms=7, label="best step")
    ax.set_xlim(0, 1.04 * max(r.budget or 0, steps[-1]))  # to the budget: a patience stop shows
    ax.set_ylim(bottom=0)
    ax.set_title(f"{r.setting}/{r.scope}\n{r.pair}", fontsize=7)
    ax.tick_params(labelsize=7)
    ax.set_xlabel("step", fontsize=7)
    ax.set_ylabel("held-out barrier (nats)", fontsize=7)
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=6)
  for ax in axes[len(found):]:
    ax.set_visible(False)
  fig.suptitle("learned method: held-out barrier\nagainst steps, one pair per row", fontsize=8)
  fig.tight_layout()
  atomic_io.save_figure(fig, path, dpi=100)
  return path


if __name__ == "__main__":  # python -m experiments.report.learned_curves: results/learned_curves.png
  print(plot(committed.RESULTS_ROOT, os.path.join(committed.RESULTS_ROOT, FIGURE)))
