"""Reports of the LMC study: summaries over pairs, ``summary.md`` and figures.

Every number here is computed from the per-pair curves that the study wrote
into ``results.json``; nothing is typed in.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib import figure  # bare Figures, no pyplot: the caller's backend stays as it is

from experiments.report import seed_statistics
from experiments.workdir import atomic_io

METHOD_LABELS = {"naive": "naive", "perm": "Variant 1 (Stage 1)", "ortho": "Variant 2 (+ ortho init)",
                 "full": "full (+ gradient refinement)", "learned": "learned (+ loss of the path)"}
# Below this mean naive loss barrier (nats, or bits per byte on text) a ratio to naive is
# float32 noise divided by noise: reports print the barrier and no ratio.
RATIO_FLOOR = 0.02
# The paired differences that reports show: (x, y) for x - y, in % of naive.
DIFFERENCES = (("ortho", "perm"), ("full", "ortho"), ("learned", "full"),
               ("activation", "full"), ("learned", "activation"))
REPAIRED = "+repair"  # the suffix of a method's REPAIRed path (the study's ``study.repair``)
# A method's circuit path (the study's ``study.circuit_path``): its entry in a pair's method, and
# the prefix of its summaries in the method's row ("circuit_loss_barrier_mean", ...).
CIRCUIT = "circuit"
CIRCUIT_PATH = "circuit_path"  # the key of ``CIRCUIT_NOTE`` in a scope's results.json
CIRCUIT_NOTE = (
    "a comparison measure: each method's aligned pair (A, g.B) on the path that interpolates "
    "every attention head's circuits W_Q W_K^T and W_V W_O (Theus et al.), every other "
    "parameter on the straight line (attn_symmetry.circuit_path); its interior points are "
    "models of twice the head width, not of the original architecture, and it is blind to the "
    "GL(H) matrices of the attention group. circuit_*_ratio_pct divides by the ordinary "
    "(straight-line) naive barrier (docs/lmc.md, 'The circuit path').")
COLORS = {"naive": "tab:gray", "perm": "tab:orange", "ortho": "tab:blue", "full": "tab:green",
           "activation": "tab:purple", "learned": "tab:red"}


def _finite(values: Sequence[float | None]) -> np.ndarray:
  """The values that are numbers (None, NaN and infinities left out)."""
  return np.asarray([x for x in values if x is not None and math.isfinite(x)], np.float64)


def _mean_std(values: Sequence[float | None]) -> tuple[float | None, float | None]:
  """Mean and (population) std of the finite values; (None, None) if there are none."""
  v = _finite(values)
  if not len(v):
    return None, None
  return float(v.mean()), float(v.std())


def ci95(values: Sequence[float | None]) -> float | None:
  """Half-width of the 95 % confidence interval of the mean of the finite values:
  t_{0.975, n-1} s / sqrt(n), with s the sample std (ddof 1); None for fewer than 2.

  The study's pairs share seeds (5 seeds give 10 pairs), so they are not
  independent draws and this pair-level interval is not one over the unit of
  replication (the seed-level one is 0.9-2.8x as wide on the committed results); reports show the seed-level interval of
  ``seed_statistics`` instead and keep this one in results.json as
  ``*_ci95``, labelled pair-level.
  """
  v = _finite(values)
  if len(v) < 2:
    return None
  return seed_statistics.t_quantile(0.975, len(v) - 1) * float(v.std(ddof=1)) / math.sqrt(len(v))


def ratio_pct(value: float, naive: float, eps: float = 1e-12) -> float | None:
  """value / naive * 100, or None when the naive barrier is zero (nothing to reduce)."""
  return None if naive <= eps else 100.0 * value / naive


def seed_pairs(pairs: Sequence[Mapping[str, Any]], values: Sequence[float | None]
               ) -> list[seed_statistics.Pair] | None:
  """(seed a, seed b, value) per pair; None when the entries do not name their seeds."""
  if not all("a" in p and "b" in p for p in pairs):
    return None
  return [(p["a"], p["b"], v) for p, v in zip(pairs, values)]


def ratio_pairs(pairs: Sequence[Mapping[str, Any]], method: str, metric: str = "loss_barrier"
                ) -> list[seed_statistics.Pair] | None:
  """(seed a, seed b, ``method``'s barrier as % of naive's, ``ratio_pct``) per pair; None
  when the entries do not name their seeds."""
  return seed_pairs(pairs, [ratio_pct(p["methods"][method][metric],
                                       p["methods"]["naive"][metric]) for p in pairs])


def _seed_ci(pairs: Sequence[Mapping[str, Any]], values: Sequence[float | None]
             ) -> list[float] | None:
  seeded = seed_pairs(pairs, values)
  return None if seeded is None else seed_statistics.interval_record(
      seed_statistics.jackknife(seeded))


def _ratio_of_means(method: Sequence[float | None], naive: Sequence[float | None]
                    ) -> float | None:
  """100 * mean(method) / mean(naive) over the pairs where both are finite."""
  both = [(m, z) for m, z in zip(method, naive)
          if m is not None and z is not None and math.isfinite(m) and math.isfinite(z)]
  if not both:
    return None
  return ratio_pct(float(np.mean([m for m, _ in both])), float(np.mean([z for _, z in both])))


def summarise_methods(pairs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
  """Every method's barriers and barrier ratios to naive over the pairs, with intervals.

  A pair whose barrier is not finite (a diverged path) is left out of that
  barrier's statistics, and ``<metric>_num_finite`` says how many pairs are
  left; a ratio also leaves out pairs whose naive barrier is zero.

  Args:
    pairs: entries {"a": seed, "b": seed, "methods": {method: {"loss_barrier",
      "accuracy_barrier"}}}; without "a" and "b" no seed-level interval is given.

  Returns:
    {method: row}; for each metric ("loss_barrier", "accuracy_barrier") the row
    holds "<metric>_mean", "_std", "_num_finite"; the mean of per-pair ratios to
    naive "<metric>_ratio_pct" and its "_std"; "<metric>_ratio_pct_median"; the
    ratio of mean barriers "<metric>_ratio_of_means_pct"; the 95 % seed-level
    intervals ``seed_statistics.jackknife`` [low, high] of the mean barrier and
    of the mean ratio, "<metric>_seed_ci" and "<metric>_ratio_pct_seed_ci"
    (None with fewer than 3 seeds); the pair-level half-widths "<metric>_ci95"
    and "<metric>_ratio_pct_ci95" (``ci95``, too narrow: kept for comparison);
    and "num_pairs", "num_seeds".
  """
  methods = list(pairs[0]["methods"]) if pairs else []
  seeds = {s for p in pairs for s in (p.get("a"), p.get("b")) if s is not None}
  out = {}
  for m in methods:
    row: dict[str, Any] = {"num_pairs": len(pairs), "num_seeds": len(seeds)}
    for metric in ("loss_barrier", "accuracy_barrier"):
      values = [p["methods"][m][metric] for p in pairs]
      naive = [p["methods"]["naive"][metric] for p in pairs]
      row[f"{metric}_mean"], row[f"{metric}_std"] = _mean_std(values)
      row[f"{metric}_ci95"] = ci95(values)
      row[f"{metric}_seed_ci"] = _seed_ci(pairs, values)
      row[f"{metric}_num_finite"] = len(_finite(values))
      ratios = [ratio_pct(v, z) for v, z in zip(values, naive)]
      row[f"{metric}_ratio_pct"], row[f"{metric}_ratio_pct_std"] = _mean_std(ratios)
      row[f"{metric}_ratio_pct_ci95"] = ci95(ratios)
      row[f"{metric}_ratio_pct_seed_ci"] = _seed_ci(pairs, ratios)
      finite = _finite(ratios)
      row[f"{metric}_ratio_pct_median"] = float(np.median(finite)) if len(finite) else None
      row[f"{metric}_ratio_of_means_pct"] = _ratio_of_means(values, naive)
    out[m] = row
  return out


def circuit_pairs(pairs: Sequence[Mapping[str, Any]], method: str) -> list[dict[str, Any]] | None:
  """The pairs with ``method``'s circuit path as the method ``CIRCUIT`` beside their ordinary
  (straight-line) naive path; None unless every pair holds that circuit path."""
  if not pairs or not all(CIRCUIT in p["methods"][method] for p in pairs):
    return None
  return [dict(p, methods={"naive": p["methods"]["naive"], CIRCUIT: p["methods"][method][CIRCUIT]})
          for p in pairs]


def circuit_statistics(pairs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
  """The circuit path's summaries of every method whose every pair holds one (``CIRCUIT``,
  the study's ``study.circuit_path``): ``summarise_methods``' row of its circuit barriers, each
  ratio to the pair's ordinary (straight-line) naive barrier, as Theus et al. measure their
  naive barrier in ordinary weights; the keys prefixed "circuit_" ("circuit_loss_barrier_mean",
  "circuit_loss_barrier_ratio_pct", ...). Empty when no method has a circuit path."""
  out = {}
  for m in (pairs[0]["methods"] if pairs else {}):
    if (circuit := circuit_pairs(pairs, m)) is not None:
      row = summarise_methods(circuit)[CIRCUIT]
      out[m] = {f"{CIRCUIT}_{k}": v for k, v in row.items() if k not in ("num_pairs", "num_seeds")}
  return out


def pair_statistics(pairs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """What a study's results.json derives from its pairs: {"methods": ``summarise_methods``,
  with the circuit path's summaries of the methods that have one (``circuit_statistics``),
  "differences": ``paired_differences``} (``results_table.restate`` rewrites these)."""
  methods = summarise_methods(pairs)
  for m, row in circuit_statistics(pairs).items():
    methods[m] |= row
  return {"methods": methods, "differences": paired_differences(pairs)}


def paired_differences(pairs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
  """Pair by pair differences of loss-barrier ratios between the methods of
  ``DIFFERENCES`` that the pairs hold ("full - ortho": full's ratio minus Variant 2's, in
  points of % of naive), then of each method's REPAIRed path against the method
  ("full+repair - full").

  Returns:
    {"x - y": {"mean", "seed_ci" ([low, high] or None), "above", "below", "zero" (pairs
    on each side of zero), "num_pairs"}}; empty without seeds named in the pairs.
  """
  if not pairs:
    return {}
  out = {}
  held = pairs[0]["methods"]
  with_repair = [(m, m.removesuffix(REPAIRED)) for m in held if m.endswith(REPAIRED)]
  for x, y in (*DIFFERENCES, *with_repair):
    if x not in held or y not in held:
      continue
    xs, ys = ratio_pairs(pairs, x), ratio_pairs(pairs, y)
    if xs is None:
      return {}
    d = seed_statistics.paired_difference(xs, ys)
    out[f"{x} - {y}"] = {
        "mean": d.mean, "seed_ci": seed_statistics.interval_record(d.interval),
        "above": d.above, "below": d.below, "zero": d.zero,
        "num_pairs": d.above + d.below + d.zero}
  return out


def _fmt(mean: float | None, std: float | None, digits: int = 4) -> str:
  if mean is None:
    return "n/a"
  return f"{mean:.{digits}f} ± {std:.{digits}f}"


def _fmt_interval(interval: Sequence[float] | None, digits: int = 1) -> str:
  return "n/a" if interval is None else f"[{interval[0]:.{digits}f}, {interval[1]:.{digits}f}]"


def _fmt_value(value: float | None, digits: int = 1) -> str:
  return "n/a" if value is None else f"{value:.{digits}f}"


def below_floor(methods: Mapping[str, Mapping[str, Any]]) -> float | None:
  """The mean naive loss barrier when it is under ``RATIO_FLOOR`` (no ratio is shown), else
  None."""
  naive = methods.get("naive", {}).get("loss_barrier_mean")
  return naive if naive is not None and naive < RATIO_FLOOR else None


def headline(results_by_scope: Mapping[str, Mapping[str, Any]]) -> list[str]:
  """The study's headline, for a terminal: per scope (row), each method's loss barrier as % of
  naive's (column, by method name; naive itself left out), mean over pairs with its 95 %
  interval over seeds where there are 3 or more; a scope whose naive barrier is under
  ``RATIO_FLOOR`` has no ratios, and says so."""
  methods = list(dict.fromkeys(m for res in results_by_scope.values() for m in res["methods"]
                               if m != "naive"))
  rows = [["scope", *methods]]
  for scope, res in results_by_scope.items():
    floor = below_floor(res["methods"])
    if floor is not None:
      rows.append([scope, f"naive barrier {floor:.4f}, under the floor {RATIO_FLOOR}: no ratio"])
      continue
    cells = []
    for m in methods:
      row = res["methods"].get(m, {})
      ratio, interval = row.get("loss_barrier_ratio_pct"), row.get("loss_barrier_ratio_pct_seed_ci")
      cells.append("n/a" if ratio is None else f"{ratio:.1f}" + (
          f" [{interval[0]:.1f}, {interval[1]:.1f}]" if interval else ""))
    rows.append([scope, *cells])
  widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(len(rows[0]))]
  return (["loss barrier as % of naive, mean over pairs [95 % interval over seeds]:"]
          + ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows])


INTERVALS_NOTE = (
    "Mean ± std over pairs. Intervals are 95 % and follow the seeds, not the pairs: n seeds "
    "give n (n - 1) / 2 pairs, each seed in n - 1 of them, so the pairs are not independent. "
    "A leave-one-seed-out jackknife with t at n - 1 degrees of freedom (docs/lmc.md, "
    "'Intervals over seeds'). An interval says how far these seeds pin the mean down; with "
    "few seeds it is wide, and two settings whose intervals overlap are not told apart.")


def _circuit_cells(row: Mapping[str, Any], floor: float | None) -> list[str]:
  """A method's circuit path columns: its loss barrier, and as % of the ordinary naive barrier
  (none under the floor); empty cells for a method without one (a REPAIRed path)."""
  if f"{CIRCUIT}_loss_barrier_mean" not in row:
    return ["", ""]
  prefix = f"{CIRCUIT}_"
  circuit = {k.removeprefix(prefix): v for k, v in row.items() if k.startswith(prefix)}
  circuit["num_pairs"] = row["num_pairs"]
  ratio = "no ratio" if floor is not None else _fmt(circuit["loss_barrier_ratio_pct"],
                                                    circuit["loss_barrier_ratio_pct_std"], 1)
  return [_fmt_barrier(circuit, "loss_barrier"), ratio]


CIRCUIT_COLUMNS_NOTE = (
    "Circuit path: a comparison measure, not a path between models of this architecture. Each "
    "method's aligned pair on the path that interpolates every attention head's circuits "
    "W_Q W_K^T and W_V W_O (Theus et al.), every other parameter on the straight line; its "
    "interior points have heads twice as wide, and it does not see the GL(H) matrices of the "
    "attention group. Its ratio divides by the ordinary naive barrier (docs/lmc.md, 'The "
    "circuit path').")


def _method_table(methods: Mapping[str, Mapping[str, Any]]) -> list[str]:
  """Rows of every method: barriers, ratios to naive with their seed-level intervals, the
  median and the ratio of means; no loss ratio under the floor; the circuit path's loss
  barrier and its ratio to naive where a method has one (``CIRCUIT``)."""
  floor = below_floor(methods)
  circuit = any(f"{CIRCUIT}_loss_barrier_mean" in row for row in methods.values())
  lines = ["| method | loss barrier | accuracy barrier | loss barrier / naive (%) | "
           "95 % interval over seeds | median (%) | ratio of means (%) | "
           "accuracy barrier / naive (%) | 95 % interval over seeds |"
           + (" circuit path: loss barrier | circuit path: loss barrier / naive (%) |"
              if circuit else ""),
           "|---|---|---|---|---|---|---|---|---|" + "---|---|" * circuit]
  for m, row in methods.items():
    cells = [_fmt_barrier(row, "loss_barrier"), _fmt_barrier(row, "accuracy_barrier")]
    if floor is None:
      cells += [_fmt(row["loss_barrier_ratio_pct"], row["loss_barrier_ratio_pct_std"], 1),
                _fmt_interval(row.get("loss_barrier_ratio_pct_seed_ci")),
                _fmt_value(row.get("loss_barrier_ratio_pct_median")),
                _fmt_value(row.get("loss_barrier_ratio_of_means_pct"))]
    else:
      cells += ["no ratio", "", "", ""]
    cells += [_fmt(row["accuracy_barrier_ratio_pct"], row["accuracy_barrier_ratio_pct_std"], 1),
              _fmt_interval(row.get("accuracy_barrier_ratio_pct_seed_ci"))]
    if circuit:
      cells += _circuit_cells(row, floor)
    lines.append(f"| {METHOD_LABELS.get(m, m)} | " + " | ".join(cells) + " |")
  lines += ["", INTERVALS_NOTE, ""] + [CIRCUIT_COLUMNS_NOTE, ""] * circuit
  if floor is not None:
    lines += [f"The mean naive loss barrier, {floor:.4f}, is under the floor of {RATIO_FLOOR} "
              "below which a ratio to it would divide float32 noise by noise: no loss ratio is "
              "given.", ""]
  return lines


def _difference_table(differences: Mapping[str, Mapping[str, Any]]) -> list[str]:
  """Paired differences of the loss-barrier ratios, with their seed-level intervals."""
  lines = ["Paired differences of the loss barrier / naive (points of %), pair by pair:", "",
           "| difference | mean | 95 % interval over seeds | pairs below 0 | pairs above 0 |",
           "|---|---|---|---|---|"]
  for name, d in differences.items():
    x, y = name.split(" - ")
    label = f"{METHOD_LABELS.get(x, x)} − {METHOD_LABELS.get(y, y)}"
    lines.append(f"| {label} | {_fmt_value(d['mean'])} | {_fmt_interval(d['seed_ci'])} | "
                 f"{d['below']} | {d['above']} |")
  return lines + [""]


def _fmt_barrier(row: Mapping[str, Any], metric: str) -> str:
  """Mean ± std of a barrier, with the number of finite pairs when some were not."""
  text = _fmt(row[f"{metric}_mean"], row[f"{metric}_std"])
  finite, total = row.get(f"{metric}_num_finite", row["num_pairs"]), row["num_pairs"]
  return text if finite == total else f"{text} (finite in {finite} of {total} pairs)"


def _evaluation_set(res: Mapping[str, Any]) -> str:
  """"the <split> split", with the number of examples when the result records it."""
  split = f"the {res.get('eval_split', 'test')} split"
  count = res.get("eval_examples")
  return split if count is None else f"{count} examples of {split}"


_LEARNED_READS = {"dataset.train_split": "trains on",
                  "dataset.validation_split": "picks its best iterate on"}


def _overlap_note(overlap: Mapping[str, str]) -> str:
  """The sentence saying that the "learned" method read the evaluation split's records
  (``scope_study.learned_overlap``: {config field: split})."""
  reads = " and ".join(f"{_LEARNED_READS[f]} config.{f} {split!r}" for f, split in overlap.items())
  return (f"The \"learned\" method {reads}, which share{'s' if len(overlap) == 1 else ''} "
          "records with this split: its barrier here is not held out (the other methods read "
          "no data).")


def study_title(config: Mapping[str, Any]) -> str:
  """summary.md's title: the model family and the data set the study evaluates on (the
  re-initialised runs' own, where they fine-tune on another); ``config`` is a run's config
  (a ConfigDict, or its config.json)."""
  dataset = config["reinit"]["dataset"] or config["dataset"]["name"]
  return f"LMC study: {config['model']['family']} on {dataset}"


def markdown_summary(title: str, results_by_scope: Mapping[str, Mapping[str, Any]]) -> str:
  """``summary.md``: per scope, the barrier table and the Table 1 ablations."""
  lines = [f"# {title}", ""]
  for scope, res in results_by_scope.items():
    lines += [f"## Re-initialisation scope: {scope}", "",
              f"{len(res['pairs'])} checkpoint pair(s), {len(res['lambdas'])} interpolation points"
              f" on {_evaluation_set(res)}. Endpoint metrics: " +
              ", ".join(f"{name} loss {m['loss']:.4f} acc {m['accuracy']:.4f}"
                        for name, m in res.get("endpoints", {}).items()), ""]
    if res.get("learned_overlap"):
      lines += [_overlap_note(res["learned_overlap"]), ""]
    lines += _method_table(res["methods"])
    differences = res.get("differences")
    if differences is None:  # results stored before the report computed them
      differences = paired_differences(res["pairs"])
    if differences and below_floor(res["methods"]) is None:
      lines += _difference_table(differences)
    floor = below_floor(res["methods"])  # L-hat and the distances' ratios divide by naive too
    abl = res.get("ablation", {})
    if "permutations" in abl:
      s = abl["permutations"]["summary"]
      lines += [f"### Stage 1 ablation (Table 1 layout): the head permutation Stage 1 chose, ranked "
                f"among all {abl['permutations']['num_permutations']}, each followed by Stage 2", "",
                "| | Rank (loss) | L̂ (loss) | Rank (accuracy) | L̂ (accuracy) |", "|---|---|---|---|---|",
                f"| Stage 1 | {_fmt(s['loss_rank_mean'], s['loss_rank_std'], 2)} | "
                f"{'no ratio' if floor is not None else _fmt(s['loss_lhat_mean'], s['loss_lhat_std'], 1)} | "
                f"{_fmt(s['accuracy_rank_mean'], s['accuracy_rank_std'], 2)} | "
                f"{_fmt(s['accuracy_lhat_mean'], s['accuracy_lhat_std'], 1)} |", ""]
    if "distances" in abl:
      lines += ["### Stage 1 head distance (full method)", "",
                "| distance | loss barrier | loss barrier / naive (%) |", "|---|---|---|"]
      for d, row in abl["distances"].items():
        ratio = ("no ratio" if floor is not None else
                 _fmt(row["loss_barrier_ratio_pct"], row["loss_barrier_ratio_pct_std"], 1))
        lines.append(f"| {d} | {_fmt_barrier(row, 'loss_barrier')} | {ratio} |")
      lines.append("")
    rob = res.get("robustness")
    if rob:
      lines += ["### Robustness (accuracy under input noise, mean over pairs)", "",
                "| noise | " + " | ".join(rob["models"]) + " |",
                "|---" * (len(rob["models"]) + 1) + "|"]
      for i, sigma in enumerate(rob["noise_levels"]):
        lines.append(f"| {sigma:g} | " + " | ".join(f"{rob['accuracy'][m][i]:.4f}" for m in rob["models"]) + " |")
      lines.append("")
  return "\n".join(lines)


def training_cell(training: dict[str, dict[str, Any]], scope: str) -> str:
  """How the runs of ``scope`` ended, from ``run.json``'s "training" (``saved_runs.steps_taken``
  and the final test evaluation): how many stopped at a validation plateau and how many at
  their budget, the range of steps taken and of test losses reached; the base model's too
  when the scope fine-tunes it. "n/a" for a run recorded without them."""
  def ended(runs: list[dict[str, Any]], count: bool = True) -> str:
    counts = collections.Counter(r.get("stopped") or "unfinished" for r in runs)
    how = ", ".join(f"{counts[k]} {k}" if count else k
                    for k in ("plateau", "budget", "unfinished") if counts[k])
    return f"{how}; {_span([r['steps'] for r in runs], '{:,}')} steps; test loss " \
           f"{_span([r['loss'] for r in runs], '{:.3f}')}"
  runs = [m for name, m in training.items() if name.startswith(f"reinit/{scope}/")]
  if not runs or any("steps" not in r or "loss" not in r for r in runs):
    return "n/a"
  cell = f"seeds: {ended(runs)}"
  base = training.get("base")
  if scope != "full" and base and "steps" in base and "loss" in base:
    cell += f"; base: {ended([base], count=False)}"
  return cell


def _span(values: list[float], fmt: str) -> str:
  low, high = min(values), max(values)
  return fmt.format(low) if low == high else f"{fmt.format(low)}–{fmt.format(high)}"


def _finish(fig, title: str, path: str, *, dpi: int) -> str:
  """Titles ``fig``, writes it to ``path`` atomically (``atomic_io.save_figure``)."""
  fig.suptitle(title)
  fig.tight_layout()
  atomic_io.save_figure(fig, path, dpi=dpi)
  return path


def plot_curves(path: str, title: str, lambdas: Sequence[float],
                pairs: Sequence[Mapping[str, Any]], *, loss_name: str = "loss") -> str:
  """PNG with the loss and accuracy along the path, mean ± std over pairs per method,
  written atomically (``atomic_io.save_figure``)."""
  lams = np.asarray(lambdas)
  fig = figure.Figure(figsize=(10, 3.8))
  axes = fig.subplots(1, 2)
  for ax, metric, ylabel in ((axes[0], "loss", loss_name), (axes[1], "accuracy", "accuracy")):
    for m in pairs[0]["methods"]:
      curves = np.asarray([p["methods"][m][metric] for p in pairs], np.float64)
      mean, std = curves.mean(0), curves.std(0)
      ax.plot(lams, mean, label=METHOD_LABELS.get(m, m), color=COLORS.get(m))
      ax.fill_between(lams, mean - std, mean + std, alpha=0.2, color=COLORS.get(m))
    ax.set_xlabel("λ (0 = model A, 1 = aligned model B)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=8)
  return _finish(fig, title, path, dpi=120)


def plot_permutation_curves(path: str, title: str, lambdas: Sequence[float],
                            per_pair: Sequence[Mapping[str, Any]],
                            naive: Sequence[Sequence[float]], *, loss_name: str = "loss",
                            most_pairs: int = 10) -> str:
  """PNG of the Table 1 ablation's paths: for each pair (at most ``most_pairs``), the loss
  along the path after every head permutation followed by Stage 2 (grey), the one Stage 1
  chose (green), the best of them (blue, dashed) and the naive path (black, dotted).

  Args:
    path: the PNG, written atomically.
    title: the figure's title.
    lambdas: the interpolation points.
    per_pair: the study's ``ablation.permutations.per_pair`` entries, each with
      "loss_curves" [P][len(lambdas)], "loss_barriers" [P] and "chosen".
    naive: each pair's naive loss curve, in the order of ``per_pair``.
    loss_name: the y-axis label.
    most_pairs: how many pairs get a panel.
  """
  lams = np.asarray(lambdas)
  shown = list(per_pair)[:most_pairs]
  cols = min(5, len(shown))
  rows = -(-len(shown) // cols)
  fig = figure.Figure(figsize=(3.2 * cols, 2.8 * rows))
  axes = fig.subplots(rows, cols, squeeze=False, sharex=True)
  for i, (ax, abl) in enumerate(zip(axes.flat, shown)):
    curves = np.asarray(abl["loss_curves"], np.float64)
    best = int(np.argmin(abl["loss_barriers"]))
    for curve in curves:
      ax.plot(lams, curve, color="0.6", lw=0.7, alpha=0.7)
    ax.plot(lams, naive[i], color="black", ls=":", lw=1.2, label="naive")
    ax.plot(lams, curves[best], color="tab:blue", ls="--", lw=1.2, label="best permutation")
    ax.plot(lams, curves[abl["chosen"]], color="tab:green", lw=1.6,
            label=f"Stage 1 (rank {abl['loss_rank']})")
    ax.set_title(f"pair {i + 1}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
  for ax in axes.flat[len(shown):]:
    ax.axis("off")
  for ax in axes[-1]:
    ax.set_xlabel("λ")
  for ax in axes[:, 0]:
    ax.set_ylabel(loss_name)
  return _finish(fig, title, path, dpi=100)


def rank_and_lhat(chosen: float, all_barriers: Sequence[float], naive: float) -> tuple[int, float | None]:
  """Rank (1 = best) of Stage 1's barrier among every permutation's, and
  L̂ = (L_method - L_top1) / (L_naive - L_top1) * 100 (None if naive is already the best)."""
  values = np.asarray(all_barriers, np.float64)
  top1 = float(values.min())
  rank = 1 + int(np.sum(values < chosen - 1e-12))
  return rank, ratio_pct(chosen - top1, naive - top1)


def summarise_permutation_ablation(per_pair: Sequence[Mapping[str, float]]) -> dict[str, float | None]:
  """Mean and std over pairs of {loss,accuracy}_{rank,lhat}."""
  out = {}
  for key in ("loss_rank", "loss_lhat", "accuracy_rank", "accuracy_lhat"):
    out[f"{key}_mean"], out[f"{key}_std"] = _mean_std([p[key] for p in per_pair])
  return out
