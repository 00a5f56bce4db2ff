"""The table of ``results/README.md``: every committed setting's numbers, generated.

``python experiments/reproduce.py --table`` calls ``write``, which replaces the
text between the README's markers with ``markdown(results_root)``: per setting
and scope, the barriers as shares of naive, Stage 1's rank and L-hat, the wall
time, the commit and the command, all read from ``results/<setting>/run.json``,
``config.json`` and ``<scope>/results.json``; nothing is typed in. It also
writes the verdict on each of the paper's claims (``claims.verdict_table``).
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

from experiments import atomic_io
from experiments import claims
from experiments import report

MARK_BEGIN = "<!-- table: written by experiments/reproduce.py --table; do not edit -->"
MARK_END = "<!-- end of table -->"
VERDICTS_BEGIN = ("<!-- verdicts: written by experiments/reproduce.py --table from "
                  "experiments/claims.py; do not edit -->")
VERDICTS_END = "<!-- end of verdicts -->"


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
  interval over seeds], or "no ratio" under ``report.RATIO_FLOOR``), Stage 1's rank and L-hat, the wall time, the commit the run
  started from and its command; then the settings' total and longest wall time."""
  methods = ("perm", "ortho", "full", "learned")
  lines = ["| setting | scope | pairs | naive loss barrier | Variant 1 (%) | Variant 2 (%) | "
           "full (%) | learned (%) | rank of Stage 1 (of 24) | L̂ (%) | wall time | commit | "
           "command |",
           "|" + "---|" * 13]
  minutes, intervals = {}, []
  for setting in sorted(os.listdir(results_root)):
    run_path = os.path.join(results_root, setting, "run.json")
    if not os.path.exists(run_path):
      continue
    with open(run_path) as f:
      run = json.load(f)
    minutes[setting] = run["wall_seconds"] / 60
    start = datetime.datetime.fromisoformat(run["started"]).timestamp()
    intervals.append((start, start + run["wall_seconds"]))
    with open(os.path.join(results_root, setting, "config.json")) as f:
      scopes = json.load(f)["reinit"]["scopes"]
    for scope in scopes:
      with open(os.path.join(results_root, setting, scope, "results.json")) as f:
        res = json.load(f)
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
          + f" | {rank} | {lhat} | {run['wall_seconds'] / 60:.0f} min | {_commit(run)} | "
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


def restate(setting_dir: str) -> list[str]:
  """Rewrites what a committed setting's reports derive from its measured pairs, as the
  current code derives it: each scope's ``results.json`` "methods" and "differences"
  (``report.pair_statistics``: the seed-level intervals of reports stored before them) and the setting's ``summary.md``, as the study writes them.
  The pairs, curves, endpoints and ablations stay as measured (the distance ablation's
  summaries too: its pairs are not stored). Returns the paths whose bytes changed."""
  with open(os.path.join(setting_dir, "config.json")) as f:
    config = json.load(f)
  title = report.study_title(config)
  results, changed = {}, []
  for scope in config["reinit"]["scopes"]:
    path = os.path.join(setting_dir, scope, "results.json")
    with open(path) as f:
      stored = json.load(f)
    derived = report.pair_statistics(stored["pairs"])
    kept = [k for k in stored if k not in derived]
    at = kept.index("ablation") if "ablation" in kept else len(kept)  # the study's order
    res = {**{k: stored[k] for k in kept[:at]}, **derived, **{k: stored[k] for k in kept[at:]}}
    results[scope] = res
    changed += _write_if_changed(path, json.dumps(res, indent=1))
  summary = os.path.join(setting_dir, "summary.md")
  return changed + _write_if_changed(summary, report.markdown_summary(title, results))


def _write_if_changed(path: str, text: str) -> list[str]:
  with open(path) as f:
    if f.read() == text:
      return []
  atomic_io.write_text(path, text)
  return [path]


def setting_dirs(results_root: str) -> list[str]:
  """Every committed run's folder under ``results_root``: each setting's, and its reduced
  form's (``<setting>/reduced``) where committed."""
  dirs = []
  for setting in sorted(os.listdir(results_root)):
    for d in (os.path.join(results_root, setting), os.path.join(results_root, setting, "reduced")):
      if all(os.path.exists(os.path.join(d, name)) for name in ("run.json", "config.json")):
        dirs.append(d)
  return dirs


def write(results_root: str) -> str:
  """Restates every committed run (``restate``), then replaces the generated blocks of
  ``results_root/README.md``: the table (between ``MARK_BEGIN`` and ``MARK_END``) and the
  verdicts on the paper's claims (``claims.verdict_table``, between ``VERDICTS_BEGIN`` and
  ``VERDICTS_END``)."""
  for d in setting_dirs(results_root):
    restate(d)
  path = os.path.join(results_root, "README.md")
  with open(path) as f:
    text = f.read()
  text = _replace_between(text, MARK_BEGIN, MARK_END, markdown(results_root), path)
  text = _replace_between(text, VERDICTS_BEGIN, VERDICTS_END,
                          claims.verdict_table(results_root).rstrip("\n"), path)
  atomic_io.write_text(path, text)
  return path
