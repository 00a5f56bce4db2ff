"""The LMC study of the paper's Section 6, run after training (docs/lmc.md, 'Pairs and methods').

For every re-initialisation scope of the config and every pair (A, B) of its
re-initialised seeds, each matching method aligns B to A inside the scope
(``matching.align_model`` with the scope's parameter prefixes), and the path
theta(lambda) = (1 - lambda) theta_A + lambda g.theta_B is evaluated at
``study.num_lambdas`` points by one compiled function (its ends, the
seeds' own models up to a symmetry, each evaluated once), on the first
``study.eval_examples`` examples of ``study.eval_split``: the test split by
default, or the training slice for the barrier of the fitted objective (the
methods that train on a loss then train on the data they are evaluated on, which
``summary.md`` says). Then:

* barriers per pair and method, and their mean, std and ratio to naive;
* for the "first_attention" scope with at most ``study.max_exhaustive_heads``
  heads: every head permutation followed by Stage 2 (the paper's Table 1
  ablation), giving the rank of Stage 1's choice and L̂;
* for the "first_attention" scope, the full method under every Stage 1 head
  distance of ``study.distances``;
* accuracy of the endpoints and of each method's midpoint under input noise
  (the paper's Appendix L).

Each (scope, pair, stage) result is stored under
``workdir/study/<scope>/pairs/`` with the fields it depends on
(``fingerprints.py``: the model, the options the stage uses, the content
hashes of both checkpoints and of the evaluation data); a rerun reuses a
result whose fields are unchanged and recomputes one whose fields changed,
logging once per scope and change which fields did. A stage file that does
not parse is recomputed with a warning naming it. Reports, each rewritten
only when the results it is drawn from changed
(``study/report_fingerprints.json``): ``study/<scope>/results.json``,
``study/<scope>/curves.png`` and ``study/summary.md``, in the layout of a run's folder under
``results/`` (``committed.py`` names the files), into which the runner copies them. Every file
is written
atomically (``atomic_io.py``). The study runs on finished, verified
checkpoints only (``saved_runs.load_checkpoints``).

Devices and processes. The study evaluates paths on the device mesh (the
evaluation batches split over all devices of all processes) and matches on one
device of every process: the endpoints are loaded as host copies, and every
matching computation (each process runs them all, on the same data, and gets the
same elements) runs where its inputs are, on the process's first device. A
matching program replicated over several CPU devices can deadlock: jaxlib's
batched LAPACK kernels (the SVDs and solves of Stage 2) split their batch over
XLA's intra-op thread pool and wait for the pieces, and when every thread of
that pool (one per core) is running such a kernel for one of the devices, no
thread is left to run the pieces (seen on 2 cores with 2 devices, in the
24-permutation ablation). Every process computes every stage; process 0 alone
decides from the files which stages to reuse and writes the files
(``result_cache.py``, ``processes.py``); the learned method reads the whole
global batches in every process (``inputs.train_batches(whole=True)``).

This module is the driver; the pieces live in ``scope_study.py`` (the
per-pair measurements of one scope and its result), ``path_evaluation.py``
(the evaluation set and the paths on it), ``input_noise.py`` (the
robustness check's noise) and ``result_cache.py`` (the cached stage results
and reports).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import ml_collections

from attn_symmetry import matching
from attn_symmetry import models
from attn_symmetry import runtime
from attn_symmetry import tasks
from experiments.report import committed
from experiments.report import report
from experiments.setting import config_checks
from experiments.setting import fingerprints
from experiments.study import path_evaluation
from experiments.study import result_cache
from experiments.study import scope_study
from experiments.train import inputs
from experiments.train import reinit
from experiments.train import saved_runs
from experiments.workdir import atomic_io
from experiments.workdir import processes

log = logging.getLogger(__name__)
log.setLevel(logging.INFO)


def check_scopes(config: ml_collections.ConfigDict, model) -> None:
  """Raises ValueError for a re-initialisation scope that no symmetry of the model acts on
  alone (there would be nothing to align)."""
  for scope in config.reinit.scopes:
    paths = reinit.scope_paths(model, scope)
    if not matching.active_names(model.spec, paths):
      raise ValueError(f"config.reinit.scopes: scope {scope!r} re-initialises {paths}, which no "
                       "symmetry factor or attention site of the model acts on alone: nothing to align")


def reports_folder(workdir: str) -> str:
  """Where the study of ``workdir`` writes its reports: ``<workdir>/study``."""
  return os.path.join(workdir, "study")


def run_study(config: ml_collections.ConfigDict, workdir: str) -> dict[str, str]:
  """Runs (or resumes) the study of every re-initialisation scope; returns the report paths.

  The config and its batches' shares over the processes are checked first unless they were
  for this run (``config_checks.validated``: ``main.py`` checks both once, before every stage).

  Raises:
    ValueError: a bad study config, a scope with nothing to align, an evaluation
      split the data set lacks, or checkpoints that are missing, unfinished or trained
      with other fields
      (``saved_runs.load_checkpoints``), before any work.
    checkpoints.CorruptCheckpointError: a damaged endpoint (one line naming it).
  """
  checked = config_checks.validated(config)
  if not checked:
    config_checks.validate(config)
  if not config.reinit.scopes:
    log.info("config.reinit.scopes is empty: no study to run")
    return {}
  if not checked:
    inputs.check_processes(config)
  model = inputs.create_model(config)
  check_scopes(config, model)
  dataset = config.reinit.dataset or config.dataset.name
  batches = path_evaluation.evaluation_examples(config, dataset)
  # Host copies: matching runs on one device of each process (the module docstring says why).
  checkpoints = saved_runs.load_checkpoints(config, workdir, require_complete=True, on_host=True)
  if config.study.match_residual == "orthogonal":  # the O(d - 1) residual reads no tied head
    model, checkpoints = untied(model, checkpoints)
  data_fp = fingerprints.key({"dataset": dataset,
                              "examples": path_evaluation.examples_digest(batches)})
  info = inputs.dataset_info(config, dataset)
  evaluator = path_evaluation.PathEvaluator(
      model, batches, chunk_size=config.study.lambda_chunk,
      bits_per_byte=model.task in (tasks.LM, tasks.MLM) and info.byte_level)
  reports = result_cache.Reports(reports_folder(workdir))
  paths, results = {}, {}
  for scope in config.reinit.scopes:
    study = scope_study.ScopeStudy(config, model, scope, checkpoints, evaluator, workdir, data_fp)
    start = time.perf_counter()
    with runtime.single_threaded_blas():  # Stage 2's batched LAPACK calls (runtime's docstring)
      res = study.run()
    log.info("study of scope %s: %d stage(s) computed, %d reused, %.1fs", scope, study.computed,
             study.reused, time.perf_counter() - start)
    results[scope] = res
    name = committed.scope_file(scope)
    paths[name] = reports.write(name, res,
                                lambda p, res=res: atomic_io.write_json(p, res, indent=1))
    title = f"{config.model.family} on {dataset}: re-initialised {scope}"
    loss_name = f"{res['eval_split']} loss ({res['loss_unit']})"
    name = committed.scope_file(scope, committed.CURVES)
    paths[name] = reports.write(
        name, [title, loss_name, res["lambdas"], res["pairs"]],
        lambda p, res=res, title=title, loss_name=loss_name: report.plot_curves(
            p, title, res["lambdas"], res["pairs"], loss_name=loss_name))
    if "permutations" in res["ablation"]:
      per_pair = res["ablation"]["permutations"]["per_pair"]
      naive_of = {(p["a"], p["b"]): p["methods"]["naive"]["loss"] for p in res["pairs"]}
      naive = [naive_of[q["a"], q["b"]] for q in per_pair]
      perm_title = (f"{title}: the path after each of the "
                    f"{per_pair[0]['num_permutations']} head permutations + Stage 2")
      name = committed.scope_file(scope, committed.PERMUTATION_CURVES)
      paths[name] = reports.write(
          name, [perm_title, loss_name, res["lambdas"], per_pair, naive],
          lambda p, per_pair=per_pair, naive=naive, perm_title=perm_title, loss_name=loss_name,
          res=res: report.plot_permutation_curves(p, perm_title, res["lambdas"], per_pair, naive,
                                                  loss_name=loss_name))
  title = report.study_title(config)
  paths[committed.SUMMARY] = reports.write(
      committed.SUMMARY, [title, results],
      lambda p: atomic_io.write_text(p, report.markdown_summary(title, results)))
  if reports.written:
    log.info("study reports written: %s", ", ".join(reports.written))
  processes.barrier("study reports")  # every process returns once process 0 has written them
  return paths


def untied(model, checkpoints: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
  """(model, checkpoints) with a tied output head untied (``models.untie_head``: the same
  functions, the head a copy of the embedding), as the O(d - 1) residual of
  ``study.match_residual`` "orthogonal" needs; a model without a tied head as it is."""
  return (models.untie_head(model)[0],
          {name: models.untie_head(model, params)[1] for name, params in checkpoints.items()})


def results_by_scope(paths: Mapping[str, str]) -> dict[str, dict[str, Any]]:
  """{scope: its results} read back from the reports ``run_study`` returned (``paths``)."""
  out = {}
  for name, path in paths.items():
    scope, _, file = name.rpartition("/")
    if scope and file == committed.RESULTS:
      with open(path, encoding="utf-8") as f:
        out[scope] = json.load(f)
  return out
