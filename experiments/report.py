"""Reports of the LMC study: summaries over pairs, ``summary.md`` and figures.

Every number here is computed from the per-pair curves that the study wrote
into ``results.json``; nothing is typed in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import scipy.stats
from matplotlib import figure  # bare Figures, no pyplot: the caller's backend stays as it is

from experiments import atomic_io

METHOD_LABELS = {"naive": "naive", "perm": "Variant 1 (Stage 1)", "ortho": "Variant 2 (+ ortho init)",
                 "full": "full (+ gradient refinement)", "learned": "learned (+ loss of the path)"}
_COLORS = {"naive": "tab:gray", "perm": "tab:orange", "ortho": "tab:blue", "full": "tab:green",
           "learned": "tab:red"}


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
  independent draws and this interval is narrower than an interval over
  independent pairs would be; it says how well the mean is pinned down by
  these pairs, not more.
  """
  v = _finite(values)
  if len(v) < 2:
    return None
  return float(scipy.stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v)))


def ratio_pct(value: float, naive: float, eps: float = 1e-12) -> float | None:
  """value / naive * 100, or None when the naive barrier is zero (nothing to reduce)."""
  return None if naive <= eps else 100.0 * value / naive


def summarise_methods(pairs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float | None]]:
  """Mean and std over pairs of every method's barriers and barrier ratios to naive.

  A pair whose barrier is not finite (a diverged path) is left out of that
  barrier's mean, std and ratio, and ``<metric>_num_finite`` says how many
  pairs are left; a ratio also leaves out pairs whose naive barrier is zero.

  Args:
    pairs: entries {"methods": {method: {"loss_barrier", "accuracy_barrier"}}}.

  Returns:
    {method: {"loss_barrier_mean", "loss_barrier_std", "accuracy_barrier_mean",
    "accuracy_barrier_std", "loss_barrier_ratio_pct", "loss_barrier_ratio_pct_std",
    "accuracy_barrier_ratio_pct", "accuracy_barrier_ratio_pct_std", "num_pairs",
    "loss_barrier_num_finite", "accuracy_barrier_num_finite"}} and the
    half-widths of the 95 % intervals of the means (``ci95``):
    "<metric>_ci95", "<metric>_ratio_pct_ci95" (None for one pair).
  """
  methods = list(pairs[0]["methods"]) if pairs else []
  out = {}
  for m in methods:
    row: dict[str, float | None] = {"num_pairs": len(pairs)}
    for metric in ("loss_barrier", "accuracy_barrier"):
      values = [p["methods"][m][metric] for p in pairs]
      row[f"{metric}_mean"], row[f"{metric}_std"] = _mean_std(values)
      row[f"{metric}_ci95"] = ci95(values)
      row[f"{metric}_num_finite"] = len(_finite(values))
      ratios = [ratio_pct(p["methods"][m][metric], p["methods"]["naive"][metric]) for p in pairs]
      row[f"{metric}_ratio_pct"], row[f"{metric}_ratio_pct_std"] = _mean_std(ratios)
      row[f"{metric}_ratio_pct_ci95"] = ci95(ratios)
    out[m] = row
  return out


def _fmt(mean: float | None, std: float | None, digits: int = 4) -> str:
  if mean is None:
    return "n/a"
  return f"{mean:.{digits}f} ± {std:.{digits}f}"


def _fmt_ci(half_width: float | None, digits: int = 1) -> str:
  return "n/a" if half_width is None else f"± {half_width:.{digits}f}"


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
    lines += ["| method | loss barrier | accuracy barrier | loss barrier / naive (%) | 95 % CI | "
              "accuracy barrier / naive (%) | 95 % CI |", "|---|---|---|---|---|---|---|"]
    for m, row in res["methods"].items():
      lines.append(f"| {METHOD_LABELS.get(m, m)} | {_fmt_barrier(row, 'loss_barrier')} | "
                   f"{_fmt_barrier(row, 'accuracy_barrier')} | "
                   f"{_fmt(row['loss_barrier_ratio_pct'], row['loss_barrier_ratio_pct_std'], 1)} | "
                   f"{_fmt_ci(row.get('loss_barrier_ratio_pct_ci95'))} | "
                   f"{_fmt(row['accuracy_barrier_ratio_pct'], row['accuracy_barrier_ratio_pct_std'], 1)} | "
                   f"{_fmt_ci(row.get('accuracy_barrier_ratio_pct_ci95'))} |")
    lines += ["", "Mean ± std over pairs; 95 % CI: half-width of the t interval of the mean "
              "(pairs share seeds, so it is optimistic).", ""]
    abl = res.get("ablation", {})
    if "permutations" in abl:
      s = abl["permutations"]["summary"]
      lines += [f"### Stage 1 ablation (Table 1 layout): the head permutation Stage 1 chose, ranked "
                f"among all {abl['permutations']['num_permutations']}, each followed by Stage 2", "",
                "| | Rank (loss) | L̂ (loss) | Rank (accuracy) | L̂ (accuracy) |", "|---|---|---|---|---|",
                f"| Stage 1 | {_fmt(s['loss_rank_mean'], s['loss_rank_std'], 2)} | "
                f"{_fmt(s['loss_lhat_mean'], s['loss_lhat_std'], 1)} | "
                f"{_fmt(s['accuracy_rank_mean'], s['accuracy_rank_std'], 2)} | "
                f"{_fmt(s['accuracy_lhat_mean'], s['accuracy_lhat_std'], 1)} |", ""]
    if "distances" in abl:
      lines += ["### Stage 1 head distance (full method)", "",
                "| distance | loss barrier | loss barrier / naive (%) |", "|---|---|---|"]
      for d, row in abl["distances"].items():
        lines.append(f"| {d} | {_fmt_barrier(row, 'loss_barrier')} | "
                     f"{_fmt(row['loss_barrier_ratio_pct'], row['loss_barrier_ratio_pct_std'], 1)} |")
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
      ax.plot(lams, mean, label=METHOD_LABELS.get(m, m), color=_COLORS.get(m))
      ax.fill_between(lams, mean - std, mean + std, alpha=0.2, color=_COLORS.get(m))
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
