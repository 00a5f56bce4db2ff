"""Full-model alignment from data: every method, with and without REPAIR, per committed study.

A committed (setting, scope) is "studied from data" when every pair of its ``results.json``
holds the method "activation" (activation matching; ``cpu_paper.DATA_METHODS``). ``table``
sets out each such study, one row per method of ``METHODS`` that every pair holds. With r_p(m)
the loss barrier of method m on pair p in % of that pair's naive barrier
(``report.ratio_pairs``), a row gives:

* the mean r_p(m) over the pairs and its 95 % leave-one-seed-out interval
  (``seed_statistics.jackknife``), without REPAIR and for the REPAIRed path m+repair (still in
  % of the naive barrier without REPAIR);
* REPAIR − none: the pairs' mean of r_p(m+repair) − r_p(m) in points and its interval
  (``seed_statistics.paired_difference``);
* the time of the method's alignment per pair (``matching.seconds``: the median and the range
  over the pairs; REPAIR's statistics of the merged model cost no alignment);
* the merged model at the grid's lambda nearest 1/2: its mean test loss and accuracy over the
  pairs, without and with REPAIR.

Under the table, a line per study: the endpoints' mean test loss and accuracy over its seeds,
the naive loss barrier with its interval, and the paired differences of ``DIFFERENCES`` in
points of % of naive. Every difference is ``report.paired_differences``' arithmetic
(``seed_statistics.paired_difference`` of ``report.ratio_pairs``), the numbers that
``results.json``'s "differences" hold once ``results_table.restate`` has run; a method or
REPAIRed path that some pair lacks shows "n/a".
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any, NamedTuple

from experiments.report import committed
from experiments.report import regime
from experiments.report import report
from experiments.report import seed_statistics as ss

# The method whose presence marks a study from data, and the rows, in order.
DATA_METHOD = "activation"
METHODS = ("naive", "full", "activation", "learned")
# The paired differences under the table, (x, y) for x - y in points of % of naive.
DIFFERENCES = (("activation", "full"), ("learned", "activation"))


class Row(NamedTuple):
  """One method of one study (module docstring).

  Attributes:
    method: the method's name.
    ratio, repaired: the mean loss barrier in % of naive without and with REPAIR, with its
      seed-level interval (None without one, or where the pairs lack the path).
    repair_gain: (m+repair) − m pair by pair in points (None where the pairs lack m+repair).
    seconds: the alignment's time of each pair ([] for a method that aligns nothing).
    midpoint, midpoint_repaired: (mean test loss, mean accuracy) of the merged model at the
      lambda nearest 1/2 over the pairs, without and with REPAIR (None where lacking).
  """
  method: str
  ratio: ss.Interval | None
  repaired: ss.Interval | None
  repair_gain: ss.Difference | None
  seconds: list[float]
  midpoint: tuple[float, float] | None
  midpoint_repaired: tuple[float, float] | None


class Study(NamedTuple):
  """One (setting, scope) studied from data.

  Attributes:
    setting, scope: where its results.json lies.
    loss_unit: the unit of its losses and barriers.
    lam: the lambda of the grid nearest 1/2, where ``Row.midpoint`` is read.
    num_pairs, num_seeds: its pairs and the seeds they are drawn from.
    endpoints: (mean test loss, mean accuracy) of the trained models over its seeds.
    naive_barrier: naive's mean loss barrier and its seed-level interval.
    rows: one ``Row`` per method of ``METHODS`` that every pair holds.
    differences: "x − y" -> the paired difference of ``DIFFERENCES`` (None where lacking).
  """
  setting: str
  scope: str
  loss_unit: str
  lam: float
  num_pairs: int
  num_seeds: int
  endpoints: tuple[float, float]
  naive_barrier: ss.Interval | None
  rows: list[Row]
  differences: dict[str, ss.Difference | None]


def midpoint_index(lambdas: Sequence[float]) -> int:
  """The index of the lambda nearest 1/2 (the first of two as near)."""
  return min(range(len(lambdas)), key=lambda i: abs(lambdas[i] - 0.5))


def _difference(pairs: list[dict[str, Any]], held: set[str], x: str, y: str
                ) -> ss.Difference | None:
  """x − y in points of % of naive, pair by pair; None where the pairs lack x or y."""
  if x not in held or y not in held:
    return None
  return ss.paired_difference(report.ratio_pairs(pairs, x), report.ratio_pairs(pairs, y))


def _midpoint(pairs: list[dict[str, Any]], held: set[str], method: str, at: int
              ) -> tuple[float, float] | None:
  if method not in held:
    return None
  mean = lambda key: statistics.fmean(p["methods"][method][key][at] for p in pairs)
  return mean("loss"), mean("accuracy")


def _row(pairs: list[dict[str, Any]], held: set[str], method: str, at: int) -> Row:
  repaired = method + report.REPAIRED
  ratio = lambda m: ss.jackknife(report.ratio_pairs(pairs, m)) if m in held else None
  seconds = [p["methods"][method].get("matching", {}).get("seconds") for p in pairs]
  return Row(method, ratio(method), ratio(repaired), _difference(pairs, held, repaired, method),
             [s for s in seconds if s is not None], _midpoint(pairs, held, method, at),
             _midpoint(pairs, held, repaired, at))


def study(setting: str, scope: str, res: dict[str, Any]) -> Study | None:
  """``Study`` of one scope's results.json, or None when some pair lacks ``DATA_METHOD``."""
  pairs = res["pairs"]
  held = set.intersection(*(set(p["methods"]) for p in pairs)) if pairs else set()
  if DATA_METHOD not in held:
    return None
  at = midpoint_index(res["lambdas"])
  ends = res["endpoints"].values()
  differences = {f"{x} − {y}": _difference(pairs, held, x, y) for x, y in DIFFERENCES}
  return Study(setting, scope, res["loss_unit"], res["lambdas"][at], len(pairs),
               len({s for p in pairs for s in (p["a"], p["b"])}),
               (statistics.fmean(e["loss"] for e in ends),
                statistics.fmean(e["accuracy"] for e in ends)),
               ss.jackknife([(p["a"], p["b"], p["methods"]["naive"]["loss_barrier"])
                             for p in pairs]),
               [_row(pairs, held, m, at) for m in METHODS if m in held], differences)


def studies(results_root: str) -> list[Study]:
  """Every committed (setting, scope) under ``results_root`` studied from data, by setting and
  then in the setting's order of scopes."""
  out = []
  for run in committed.runs(results_root):
    for scope in run.scopes():
      if (s := study(run.setting, scope, run.results(scope))) is not None:
        out.append(s)
  return out


def _seconds_cell(seconds: list[float]) -> str:
  if not seconds:
    return "n/a"
  return f"{statistics.median(seconds):.1f} s ({min(seconds):.1f}–{max(seconds):.1f})"


def _midpoint_cell(m: tuple[float, float] | None) -> str:
  return "n/a" if m is None else f"{m[0]:.3f} / {m[1]:.3f}"


def _difference_cell(d: ss.Difference | None) -> str:
  if d is None:
    return "n/a"
  return (f"{regime.show_interval(d.interval, 1)} points ({d.below} pairs below 0, "
          f"{d.above} above)")


def table(results_root: str) -> str:
  """Markdown: one row per method of each ``Study`` (module docstring), then a line per study
  with its endpoints, naive barrier and ``DIFFERENCES``."""
  found = studies(results_root)
  if not found:
    return f"No committed study holds the method \"{DATA_METHOD}\" yet."
  lines = ["| setting, scope | method | loss barrier, % of naive | with REPAIR, % of naive | "
           "REPAIR − none (points) | alignment time per pair: median (range) | λ = ½: test "
           "loss / accuracy | λ = ½ with REPAIR: test loss / accuracy |", "|" + "---|" * 8]
  notes = []
  for s in found:
    for i, r in enumerate(s.rows):
      where = f"`{s.setting}`, {s.scope}" if i == 0 else ""
      gain = "n/a" if r.repair_gain is None else regime.show_interval(r.repair_gain.interval, 1)
      lines.append(f"| {where} | {r.method} | {regime.show_interval(r.ratio, 1)} | "
                   f"{regime.show_interval(r.repaired, 1)} | {gain} | "
                   f"{_seconds_cell(r.seconds)} | {_midpoint_cell(r.midpoint)} | "
                   f"{_midpoint_cell(r.midpoint_repaired)} |")
    differences = "; ".join(f"{name}: {_difference_cell(d)}" for name, d in s.differences.items())
    notes.append(f"- `{s.setting}`, {s.scope} ({s.num_pairs} pairs of {s.num_seeds} seeds; "
                 f"loss in {s.loss_unit}, merged at λ = {s.lam:g}): the endpoints' test loss "
                 f"{s.endpoints[0]:.3f} and accuracy {s.endpoints[1]:.3f} (mean over the "
                 f"seeds); naive loss barrier {regime.show_interval(s.naive_barrier, 4)}; "
                 f"{differences}.")
  return "\n".join(lines + [""] + notes)
