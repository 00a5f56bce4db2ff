"""The table of ``results/README.md``: every committed setting's numbers, generated.

``python experiments/reproduce.py --table`` calls ``write``, which replaces the
text between the README's markers with ``markdown(results_root)``: per setting
and scope, the barriers as shares of naive, Stage 1's rank and L-hat, how the
runs ended, the wall time, the commit and the command, all read from
``results/<setting>/run.json``, ``config.json`` and ``<scope>/results.json``;
nothing is typed in. It also writes the verdict on each of the paper's claims
(``claims.verdict_table``), the findings that open the README
(``claims.findings``), the width sweep and its positive control
(``regime.py``), the learned method from other starts and lambda schemes and the
full-model rows with the O(d-1) residual, each against its base (``variants.py``), what
REPAIR leaves of its targets (``repair_gaps.py``), the learned method's held-out barrier against its steps, one pair per row
(``learned_curves.py``), and every method with and without REPAIR in the full-model
studies from data (``from_data.py``), and the Table 1 settings over several base
models (``bases.py``).
Before that it restates each committed run (``restate``): what its reports derive
from its measured pairs (the statistics, the seed-level intervals, summary.md)
is rewritten as the current code derives it, so that runs stored before a
statistic was added carry it too.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

from experiments.report import bases
from experiments.report import claims
from experiments.report import committed
from experiments.report import from_data
from experiments.report import learned_curves
from experiments.report import regime
from experiments.report import repair_gaps
from experiments.report import report
from experiments.report import variants
from experiments.workdir import atomic_io

MARK_BEGIN = "<!-- table: written by experiments/reproduce.py --table; do not edit -->"
MARK_END = "<!-- end of table -->"
VERDICTS_BEGIN = ("<!-- verdicts: written by experiments/reproduce.py --table from "
                  "experiments/report/claims.py; do not edit -->")
VERDICTS_END = "<!-- end of verdicts -->"
FINDINGS_BEGIN = ("<!-- findings: written by experiments/reproduce.py --table from "
                  "experiments/report/claims.py; do not edit -->")
FINDINGS_END = "<!-- end of findings -->"
TRAJECTORY_BEGIN = ("<!-- trajectory check: written by experiments/reproduce.py --table; "
                    "do not edit -->")
TRAJECTORY_END = "<!-- end of trajectory check -->"
WIDTH_BEGIN = ("<!-- width sweep: written by experiments/reproduce.py --table from "
               "experiments/report/regime.py; do not edit -->")
WIDTH_END = "<!-- end of width sweep -->"
SWEEPS_BEGIN = ("<!-- other sweeps: written by experiments/reproduce.py --table from "
                "experiments/report/regime.py; do not edit -->")
SWEEPS_END = "<!-- end of other sweeps -->"
CONTROL_BEGIN = ("<!-- positive control: written by experiments/reproduce.py --table from "
                 "experiments/report/regime.py; do not edit -->")
CONTROL_END = "<!-- end of positive control -->"
LEARNED_BEGIN = ("<!-- learned variants: written by experiments/reproduce.py --table from "
                 "experiments/report/variants.py; do not edit -->")
LEARNED_END = "<!-- end of learned variants -->"
LEARNED_CURVES_BEGIN = ("<!-- learned curves: written by experiments/reproduce.py --table from "
                        "experiments/report/learned_curves.py; do not edit -->")
LEARNED_CURVES_END = "<!-- end of learned curves -->"
RESIDUAL_BEGIN = ("<!-- residual variants: written by experiments/reproduce.py --table from "
                  "experiments/report/variants.py; do not edit -->")
RESIDUAL_END = "<!-- end of residual variants -->"
REPAIR_BEGIN = ("<!-- repair variants: written by experiments/reproduce.py --table from "
                "experiments/report/variants.py; do not edit -->")
REPAIR_END = "<!-- end of repair variants -->"
REPAIR_GAPS_BEGIN = ("<!-- repair gaps: written by experiments/reproduce.py --table from "
                     "experiments/report/repair_gaps.py; do not edit -->")
REPAIR_GAPS_END = "<!-- end of repair gaps -->"
FROM_DATA_BEGIN = ("<!-- from data: written by experiments/reproduce.py --table from "
                   "experiments/report/from_data.py; do not edit -->")
FROM_DATA_END = "<!-- end of from data -->"
BASES_BEGIN = ("<!-- bases: written by experiments/reproduce.py --table from "
               "experiments/report/bases.py; do not edit -->")
BASES_END = "<!-- end of bases -->"


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
  """The length of the union of the ``(start, end)`` intervals: how long at least one ran."""
  total, reach = 0.0, float("-inf")
  for start, end in sorted(intervals):
    if end > reach:
      total += end - max(start, reach)
      reach = end
  return total


def _cell(row: dict[str, Any] | None, key: str, floor: bool) -> str:
  """"mean ± std [low, high]" of a ratio: over pairs, and the 95 % interval over seeds
  (``report.summarise_methods``); "no ratio" under the floor."""
  if floor:
    return "no ratio"
  if not row or row.get(key) is None:
    return "n/a"
  ci = row.get(key + "_seed_ci")
  interval = "" if ci is None else f" [{ci[0]:.1f}, {ci[1]:.1f}]"
  return f"{row[key]:.1f} ± {row[key + '_std']:.1f}{interval}"


def markdown(results_root: str) -> str:
  """Markdown table of every committed setting under ``results_root``: per setting and
  scope, the pairs (and how many have a ratio, when a naive barrier is zero), the naive loss
  barrier, each method's loss barrier as % of naive (mean ± std over pairs [the 95 %
  interval over seeds], or "no ratio" under ``report.RATIO_FLOOR``), Stage 1's rank and L-hat,
  how its runs ended (``report.training_cell``), the wall time, the commit the run started from and
  its command; then the settings' total and longest wall time."""
  methods = ("perm", "ortho", "full", "learned")
  lines = ["| setting | scope | pairs | naive loss barrier | Variant 1 (%) | Variant 2 (%) | "
           "full (%) | learned (%) | rank of Stage 1 (of 24) | L̂ (%) | training | wall time | "
           "commit | command |",
           "|" + "---|" * 14]
  minutes, intervals = {}, []
  for committed_run in committed.runs(results_root):
    setting, run = committed_run.setting, committed_run.record()
    minutes[setting] = run["wall_seconds"] / 60
    start = datetime.datetime.fromisoformat(run["started"]).timestamp()
    intervals.append((start, start + run["wall_seconds"]))
    for scope in committed_run.scopes():
      res = committed_run.results(scope)
      rows = report.summarise_methods(res["pairs"])  # results stored before seed intervals too
      naive = rows["naive"]
      floor = report.below_floor(rows) is not None
      abl = res.get("ablation", {}).get("permutations", {}).get("summary")
      rank = "n/a" if not abl else f"{abl['loss_rank_mean']:.2f} ± {abl['loss_rank_std']:.2f}"
      lhat = ("n/a" if not abl or abl["loss_lhat_mean"] is None
              else "no ratio" if floor
              else f"{abl['loss_lhat_mean']:.1f} ± {abl['loss_lhat_std']:.1f}")
      # Pairs whose naive barrier is zero have no ratio (report.ratio_pct): say so.
      with_ratio = sum(report.ratio_pct(1.0, p["methods"]["naive"]["loss_barrier"]) is not None
                       for p in res["pairs"])
      pairs = naive["num_pairs"]
      if with_ratio < pairs:
        pairs = f"{pairs} (ratios over {with_ratio})"
      lines.append(
          f"| {setting} | {scope} | {pairs} | "
          f"{naive['loss_barrier_mean']:.4f} ± {naive['loss_barrier_std']:.4f} | "
          + " | ".join(_cell(rows.get(m), "loss_barrier_ratio_pct", floor) for m in methods)
          + f" | {rank} | {lhat} | {report.training_cell(run.get('training', {}), scope)} | "
          f"{run['wall_seconds'] / 60:.0f} min | {_commit(run)} | "
          f"`{run['command']}` |")
  if minutes:
    longest = max(minutes, key=minutes.get)
    total = round(sum(minutes.values()))
    busy = round(busy_seconds(intervals) / 60)
    lines += ["", f"Wall time of the {len(minutes)} settings above, added up: "
                  f"{total // 60} h {total % 60:02d} min; the longest, {longest}, "
                  f"{minutes[longest]:.0f} min."
                  + ("" if busy >= total else
                     f" Settings that ran at the same time (`run.json`: `jobs`) overlap: the "
                     f"runs above took {busy // 60} h {busy % 60:02d} min of the machines' time.")]
  return "\n".join(lines)


def _commit(run: dict[str, Any]) -> str:
  """The short commit a run started from, marked when tracked files outside ``results/``
  differed from it. Reports under ``results/`` are what runs write, never what they read:
  a setting run after another in the same tree (``--all``) finds the first one's reports
  changed, and its own code is still the commit's."""
  commit, _, edited = run.get("commit", "unknown").partition("+")  # older records: "<sha>+..."
  edited = edited or [path for path in run.get("uncommitted", ())
                      if not path.startswith("results/")]
  return commit[:7] + (" (with edits)" if edited else "")


def _replace_between(text: str, begin: str, end: str, body: str, path: str) -> str:
  if begin not in text or end not in text:
    raise ValueError(f"{path} has no markers {begin!r} ... {end!r}")
  head, rest = text.split(begin, 1)
  return f"{head}{begin}\n{body}\n{end}{rest.split(end, 1)[1]}"


def restate(run: committed.Run) -> list[str]:
  """Rewrites what a committed run's reports derive from its measured pairs, as the current
  code derives it: each scope's ``results.json`` "methods" and "differences"
  (``report.pair_statistics``: the seed-level intervals of reports stored before them) and the
  run's ``summary.md``, as the study writes them. The pairs, curves, endpoints and ablations
  stay as measured (the distance ablation's summaries too: its pairs are not stored). Returns
  the paths whose bytes changed."""
  config = run.config()
  title = report.study_title(config)
  results, changed = {}, []
  for scope in run.scopes():
    path = run.results_path(scope)
    stored = run.results(scope)
    derived = report.pair_statistics(stored["pairs"])
    kept = [k for k in stored if k not in derived]
    at = kept.index("ablation") if "ablation" in kept else len(kept)  # the study's order
    res = {**{k: stored[k] for k in kept[:at]}, **derived, **{k: stored[k] for k in kept[at:]}}
    results[scope] = res
    changed += _write_if_changed(path, json.dumps(res, indent=1))
  return changed + _write_if_changed(run.summary_path(), report.markdown_summary(title, results))


def _write_if_changed(path: str, text: str) -> list[str]:
  with open(path) as f:
    if f.read() == text:
      return []
  atomic_io.write_text(path, text)
  return [path]


def trajectory_table(results_root: str) -> str:
  """Each setting's run on every core (``<setting>/every_core``) set against its committed
  one-core run: per scope and method, the one-core run's mean with its 95 % interval over
  seeds, the every-core run's mean and interval, and whether the every-core mean falls inside
  the one-core interval (the naive barrier in the loss's unit, the methods in % of naive).

  The two runs train from the same seeds on other float32 trajectories (another thread count
  rounds sums differently): an interval over the seeds of one run says how far its mean may
  lie from the mean over all seeds *of that trajectory*; whether it also bounds another
  trajectory's mean is what this table measures."""
  lines = ["| setting | scope | method (naive: loss barrier; the others: % of naive) | "
           "one-core run: mean [95 % interval over seeds] | every-core run: mean [95 % interval "
           "over seeds] | every-core mean against the one-core interval |",
           "|---|---|---|---|---|---|"]
  runs = []
  for one_core in committed.runs(results_root):
    setting = one_core.setting
    every_core = committed.find(results_root, setting, committed.EVERY_CORE)
    if every_core is None:
      continue
    records = [one_core.record(), every_core.record()]
    runs.append(f"`{setting}`: the one-core run at {_commit(records[0])} "
                f"({records[0]['wall_seconds'] / 60:.0f} min), the run on "
                f"{records[1]['machine']['cores_used']} cores at {_commit(records[1])} "
                f"({records[1]['wall_seconds'] / 60:.0f} min, `{records[1]['command']}`).")
    for scope in one_core.scopes():
      rows = [report.summarise_methods(run.results(scope)["pairs"])
              for run in (one_core, every_core)]
      for method in ("naive", "perm", "ortho", "full", "learned"):
        # naive: the loss barrier (its mean, "loss_barrier_seed_ci"); the others: % of naive
        key, ci = (("loss_barrier_mean", "loss_barrier_seed_ci") if method == "naive" else
                   ("loss_barrier_ratio_pct", "loss_barrier_ratio_pct_seed_ci"))
        one, every = (r.get(method, {}) for r in rows)
        lines.append(f"| {setting} | {scope} | {report.METHOD_LABELS[method]} | "
                     f"{_mean_interval(one, key, ci)} | {_mean_interval(every, key, ci)} | "
                     f"{_inside(every.get(key), one.get(ci))} |")
  if not runs:
    return "No setting has a run on every core (`reproduce.py --setting=NAME --noone_core`)."
  return "\n".join(lines + [""] + runs)


def _mean_interval(row: dict[str, Any], key: str, ci_key: str) -> str:
  if row.get(key) is None:
    return "n/a"
  digits = 4 if key == "loss_barrier_mean" else 1
  ci = row.get(ci_key)
  interval = "" if ci is None else f" [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"
  return f"{row[key]:.{digits}f}{interval} ({row['num_seeds']} seeds)"


def _inside(mean: float | None, interval: list[float] | None) -> str:
  """Where ``mean`` lies against ``interval``: "inside", "above" or "below" it."""
  if mean is None or interval is None:
    return "n/a"
  low, high = interval
  return "below" if mean < low else "above" if mean > high else "inside"


def write(results_root: str) -> str:
  """Restates every committed run (``restate``), then replaces the generated blocks of
  ``results_root/README.md``: the table (between ``MARK_BEGIN`` and ``MARK_END``), the
  verdicts on the paper's claims (``claims.verdict_table``, between ``VERDICTS_BEGIN`` and
  ``VERDICTS_END``), the findings drawn from them (``claims.findings``, between
  ``FINDINGS_BEGIN`` and ``FINDINGS_END``), the trajectory check (``trajectory_table``,
  between ``TRAJECTORY_BEGIN`` and ``TRAJECTORY_END``), the ViT's width sweep, the other
  sweeps and the positive control (``regime.width_table``, ``regime.other_sweeps_table`` and
  ``regime.control_table``, between ``WIDTH_BEGIN`` and ``WIDTH_END``, ``SWEEPS_BEGIN`` and
  ``SWEEPS_END``, ``CONTROL_BEGIN`` and ``CONTROL_END``), the learned method's variants
  against their bases (``variants.table``, between ``LEARNED_BEGIN`` and ``LEARNED_END``),
  the learned method's held-out barrier against its steps (``learned_curves.table``, between
  ``LEARNED_CURVES_BEGIN`` and ``LEARNED_CURVES_END``, and its figure, ``learned_curves.plot``),
  the O(d-1) residual against the permutation residual (``variants.table`` of
  ``variants.RESIDUAL``, between ``RESIDUAL_BEGIN`` and ``RESIDUAL_END``), REPAIR's rule
  without biases against the base's (``variants.REPAIR``, between ``REPAIR_BEGIN`` and
  ``REPAIR_END``), what REPAIR leaves of its targets in every run that records it
  (``repair_gaps.table``, between ``REPAIR_GAPS_BEGIN`` and ``REPAIR_GAPS_END``), and the
  studies from data with and without REPAIR (``from_data.table``,
  between ``FROM_DATA_BEGIN`` and ``FROM_DATA_END``), and the Table 1 settings over several
  base models (``bases.table``, between ``BASES_BEGIN`` and ``BASES_END``)."""
  for run in committed.runs(results_root, reruns=True):
    restate(run)
  path = os.path.join(results_root, "README.md")
  with open(path) as f:
    text = f.read()
  text = _replace_between(text, MARK_BEGIN, MARK_END, markdown(results_root), path)
  text = _replace_between(text, VERDICTS_BEGIN, VERDICTS_END,
                          claims.verdict_table(results_root).rstrip("\n"), path)
  text = _replace_between(text, FINDINGS_BEGIN, FINDINGS_END,
                          claims.findings(results_root).rstrip("\n"), path)
  text = _replace_between(text, TRAJECTORY_BEGIN, TRAJECTORY_END,
                          trajectory_table(results_root), path)
  text = _replace_between(text, WIDTH_BEGIN, WIDTH_END, regime.width_table(results_root), path)
  text = _replace_between(text, SWEEPS_BEGIN, SWEEPS_END,
                          regime.other_sweeps_table(results_root), path)
  text = _replace_between(text, CONTROL_BEGIN, CONTROL_END, regime.control_table(results_root),
                          path)
  text = _replace_between(text, LEARNED_BEGIN, LEARNED_END, variants.table(results_root), path)
  text = _replace_between(text, LEARNED_CURVES_BEGIN, LEARNED_CURVES_END,
                          learned_curves.table(results_root), path)
  learned_curves.plot(results_root, os.path.join(results_root, learned_curves.FIGURE))
  text = _replace_between(text, RESIDUAL_BEGIN, RESIDUAL_END,
                          variants.table(results_root, variants.RESIDUAL), path)
  text = _replace_between(text, REPAIR_BEGIN, REPAIR_END,
                          variants.table(results_root, variants.REPAIR), path)
  text = _replace_between(text, REPAIR_GAPS_BEGIN, REPAIR_GAPS_END,
                          repair_gaps.table(results_root), path)
  text = _replace_between(text, FROM_DATA_BEGIN, FROM_DATA_END, from_data.table(results_root),
                          path)
  text = _replace_between(text, BASES_BEGIN, BASES_END, bases.table(results_root), path)
  atomic_io.write_text(path, text)
  return path
