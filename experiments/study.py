"""The LMC study of the paper's Section 6, run after training (docs/lmc.md, 'Pairs and methods').

For every re-initialisation scope of the config and every pair (A, B) of its
re-initialised seeds, each matching method aligns B to A inside the scope
(``matching.align_model`` with the scope's parameter prefixes), and the path
theta(lambda) = (1 - lambda) theta_A + lambda g.theta_B is evaluated on the
test split at ``study.num_lambdas`` points by one compiled function. Then:

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
``study/<scope>/curves.png`` and ``study/summary.md``. Every file is written
atomically (``atomic_io.py``). The study runs on finished, verified
checkpoints only (``train.load_checkpoints``).
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import ml_collections
import numpy as np

from attn_symmetry import group_action
from attn_symmetry import lmc
from attn_symmetry import matching
from attn_symmetry import tasks
from attn_symmetry.spec import subtree
from experiments import atomic_io
from experiments import config_checks
from experiments import evaluation
from experiments import fingerprints
from experiments import inputs
from experiments import report
from experiments import train

Params = dict[str, Any]
log = logging.getLogger(__name__)
log.setLevel(logging.INFO)


def check_scopes(config: ml_collections.ConfigDict, model) -> None:
  """Raises ValueError for a re-initialisation scope that no symmetry of the model acts on
  alone (there would be nothing to align)."""
  for scope in config.reinit.scopes:
    paths = model.scope_paths(scope)
    if not matching.active_names(model.spec, paths):
      raise ValueError(f"config.reinit.scopes: scope {scope!r} re-initialises {paths}, which no "
                       "symmetry factor or attention site of the model acts on alone: nothing to align")


# ----------------------------------------------------------------------------- caching


def cached(path: str, fields: Mapping[str, Any], compute: Callable[[], dict]
           ) -> tuple[dict, str | None]:
  """The JSON result at ``path`` if it was computed from ``fields``, else ``compute()``
  saved there (atomically) with them.

  Returns:
    (result, why): why is None when the saved result was reused, else why it
    was computed: "new" (nothing usable saved; a file that does not parse
    warns, naming it) or ``fingerprints.change_line`` of the changed fields.
  """
  fp = fingerprints.key(fields)
  saved = atomic_io.read_json_or_none(path, "study cache")
  why = "new"
  if isinstance(saved, dict) and "result" in saved:
    if saved.get("fingerprint") == fp:
      return saved["result"], None
    old = saved.get("fields")
    why = (fingerprints.change_line(old, fields) if isinstance(old, dict)
           else "inputs changed (saved before stages recorded their fields)")
  elif saved is not None:
    log.warning("study cache %s holds no result; recomputing it", path)
  result = compute()
  atomic_io.write_json(path, {"fingerprint": fp, "fields": dict(fields), "result": result})
  return result, why


# ----------------------------------------------------------------------------- evaluation


_COMPILED: dict[Any, tuple[Callable, Callable]] = {}


def _compiled(model) -> tuple[Callable, Callable]:
  """(``lmc.path_evaluator`` of the model's metrics, jitted ``apply_model`` of its spec),
  made once per model config in this process, so that a study run again in the same
  process (a notebook, the tests) reuses their compilations."""
  if model.config not in _COMPILED:
    _COMPILED[model.config] = (
        lmc.path_evaluator(lambda p, b: evaluation.batch_metrics(model, p, b)),
        jax.jit(functools.partial(group_action.apply_model, model.spec)))
  return _COMPILED[model.config]


_LOSSES: dict[Any, Callable] = {}


def _mean_loss(model) -> Callable[[Params, Mapping[str, Any]], jax.Array]:
  """loss(params, batch): the mean cross-entropy of a batch, one function object per model
  config (``matching.learn_alignment`` compiles once per loss function)."""
  if model.config not in _LOSSES:
    def loss(params, batch):
      sums = evaluation.batch_metrics(model, params, batch)
      return sums["loss"] / sums["count"]
    _LOSSES[model.config] = loss
  return _LOSSES[model.config]


class PathEvaluator:
  """Loss and accuracy along interpolation paths on a fixed evaluation set."""

  def __init__(self, model, batches: list[Mapping[str, np.ndarray]], *, chunk_size: int,
               bits_per_byte: bool):
    self.model = model
    self.batches = batches
    self.chunk_size = chunk_size
    self.bits_per_byte = bits_per_byte
    self._evaluator = _compiled(model)[0]
    mesh = inputs.create_mesh()
    self._put = lambda b: inputs.shard_batch(b, mesh)

  def __call__(self, params_a: Params, params_b: Params, lams: np.ndarray,
               batches: Iterable[Mapping[str, np.ndarray]] | None = None) -> dict[str, list[float]]:
    sums = lmc.evaluate_path(self._evaluator, params_a, params_b,
                             self.batches if batches is None else batches, lams,
                             chunk_size=self.chunk_size, put=self._put)
    loss = sums["loss"] / sums["count"]
    if self.bits_per_byte:
      loss = loss / np.log(2.0)
    return {"loss": loss.tolist(), "accuracy": (sums["correct"] / sums["count"]).tolist()}


def curve_result(curve: Mapping[str, list[float]], lams: np.ndarray) -> dict[str, Any]:
  return dict(curve, loss_barrier=lmc.barrier(lams, curve["loss"]),
              accuracy_barrier=lmc.barrier(lams, curve["accuracy"], higher_is_better=True))


def noisy(batches: Iterable[Mapping[str, np.ndarray]], level: float, *, key: jax.Array,
          input_key: str, vocab_size: int | None) -> Iterable[dict[str, np.ndarray]]:
  """Batches with noise on their inputs ``batch[input_key]``: Gaussian of std ``level``
  added to float inputs (images), or each token of integer inputs replaced by a
  uniformly random one of ``vocab_size`` with probability ``level``."""
  for i, batch in enumerate(batches):
    k1, k2 = jax.random.split(jax.random.fold_in(key, i))
    batch = dict(batch)
    x = batch[input_key]
    if np.issubdtype(x.dtype, np.floating):
      batch[input_key] = x + level * np.asarray(jax.random.normal(k1, x.shape), x.dtype)
    else:
      replace = np.asarray(jax.random.bernoulli(k1, level, x.shape))
      random = np.asarray(jax.random.randint(k2, x.shape, 0, vocab_size), x.dtype)
      batch[input_key] = np.where(replace, random, x)
    yield batch


# ----------------------------------------------------------------------------- one scope


# align_model's matching options and the config fields that set them.
_OPTION_FIELDS = {"distance": "study.distance", "steps": "study.match_steps",
                  "learning_rate": "study.match_learning_rate", "init": "study.match_init",
                  "refine": "study.match_refine"}
# What the "learned" method reads besides the full method's options: its own options and
# the training and validation batches it learns from and chooses on.
LEARNED_FIELDS = ("study.learn_steps", "study.learn_learning_rate", "study.learn_uniform_lambda",
                  "study.learn_holdout_batches", "dataset.train_split",
                  "dataset.validation_split", "train.batch_size", "dataset.augment")


def _matching_kwargs(config: ml_collections.ConfigDict, method: str = "full",
                     **changes) -> dict[str, Any]:
  """The keyword arguments of ``matching.align_model`` that ``method`` uses
  (``matching.METHOD_OPTIONS``), from ``config.study``, with ``changes`` applied."""
  s = config.study
  values = dict(distance=s.distance, steps=s.match_steps, learning_rate=s.match_learning_rate,
                init=s.match_init, refine=s.match_refine)
  return {k: changes.get(k, values[k]) for k in matching.METHOD_OPTIONS[method]}


def _option_fields(options: Mapping[str, Any], changes: Iterable[str] = ()) -> dict[str, Any]:
  """Fingerprint fields of matching ``options``: by config field name, or "ablation <name>"
  for an option an ablation sets."""
  return {f"ablation {k}" if k in changes else _OPTION_FIELDS[k]: v for k, v in options.items()}


class ScopeStudy:
  """The study of one re-initialisation scope."""

  def __init__(self, config, model, scope: str, checkpoints: Mapping[str, Params],
               evaluator: PathEvaluator, workdir: str, data_fingerprint: str):
    self.config, self.model, self.scope = config, model, scope
    self.evaluator = evaluator
    self.dir = os.path.join(workdir, "study", scope)
    self.scope_paths = model.scope_paths(scope)
    self.dataset = config.reinit.dataset or config.dataset.name  # the scope's fine-tuning data
    self.seeds = list(config.reinit.seeds)
    self.params = {s: checkpoints[f"reinit/{scope}/seed_{s}"] for s in self.seeds}
    self.digests = {s: fingerprints.tree_digest(p) for s, p in self.params.items()}
    self.lams = lmc.lambdas(config.study.num_lambdas)
    self.data_fingerprint = data_fingerprint
    self.reused = 0
    self.computed = 0
    self._announced: set[str] = set()
    self._alignments: dict[tuple, tuple[Params, Params, dict]] = {}
    self._elements: dict[tuple, tuple[dict, dict]] = {}
    # g.theta compiled once: the ablation applies one element per head permutation.
    self._apply = _compiled(model)[1]

  def _cached(self, name: str, compute: Callable[[], dict], *, a: int, b: int,
              **fields) -> dict:
    """``cached`` result of one stage of pair (a, b).

    Its fields (``fingerprints.py``): the scope's parameter paths, the model,
    the number of lambdas, the content hashes of both checkpoints and of the
    evaluation data, and the stage's own ``fields`` (the options it uses). The
    first stage of this scope recomputed for a given change logs it.
    """
    fields = {"scope paths": list(self.scope_paths),
              **fingerprints.config_fields(self.config, ("model", "study.num_lambdas",
                                                         "study.eval_examples")),
              fingerprints.INPUT + "evaluation data": self.data_fingerprint,
              fingerprints.INPUT + f"seed_{a} params": self.digests[a],
              fingerprints.INPUT + f"seed_{b} params": self.digests[b], **fields}
    start = time.perf_counter()
    path = os.path.join(self.dir, f"pairs/seed_{a}-seed_{b}", name + ".json")
    result, why = cached(path, fields, compute)
    if why is not None:
      if why != "new" and why not in self._announced:
        self._announced.add(why)
        log.info("study %s: %s; recomputing the stages that depend on it (first: %s)",
                 self.scope, why, os.path.relpath(path, self.dir))
      log.info("%s seed %d-%d: %s took %.1fs", self.scope, a, b, name,
               time.perf_counter() - start)
    self.reused += why is None
    self.computed += why is not None
    return result

  def _matching_options(self, method: str, **overrides) -> dict[str, Any]:
    return _matching_kwargs(self.config, method, **overrides)

  def _method_fields(self, method: str) -> dict[str, Any]:
    """Fingerprint fields of ``method``'s options (and, for "learned", what it learns from)."""
    fields = _option_fields(self._matching_options(method))
    if method == "learned":
      fields.update(fingerprints.config_fields(self.config, LEARNED_FIELDS))
    return fields

  def align(self, a: int, b: int, method: str, **overrides) -> tuple[Params, Params, dict]:
    """(theta_A, g.theta_B, matching info): B aligned to A in this scope.

    When the alignment maps an orthogonal residual factor, both endpoints are
    returned with their norm scales folded (``group_action.fold_norm_scales``,
    which keeps each model's function), so the path joins like with like.
    Alignments are kept for the rest of the run, so every stage that needs one
    (paths, ablations, robustness) matches each pair once.
    """
    options = self._matching_options(method, **overrides)
    key = (a, b, method, json.dumps(options, sort_keys=True))
    if key not in self._alignments:
      self._alignments[key] = self._align(a, b, method, options)
    return self._alignments[key]

  def _align(self, a: int, b: int, method: str, options: dict[str, Any]):
    pa, pb = self.params[a], self.params[b]
    if method == "naive":
      return pa, pb, {}
    element, info = self._element(a, b, method, options)
    info = _jsonable(info)
    if info.get("folded_norm_scales"):
      pa, pb = (group_action.fold_norm_scales(self.model.spec, p) for p in (pa, pb))
    return pa, self._apply(pb, element), info

  def _element(self, a: int, b: int, method: str, options: dict[str, Any]):
    """(element, info) of ``method`` for pair (a, b), kept for the rest of the run ("learned"
    starts from the "full" element of the same options)."""
    key = (a, b, method, json.dumps(options, sort_keys=True))
    if key not in self._elements:
      start = time.perf_counter()
      if method == "learned":
        full = {k: v for k, v in options.items() if k in matching.METHOD_OPTIONS["full"]}
        element, info = self._learn(a, b, self._element(a, b, "full", full))
      else:
        element, info = matching.align_model(self.model.spec, self.params[a], self.params[b],
                                             scope=self.scope_paths, method=method, **options)
      jax.block_until_ready(element)  # dispatch is asynchronous: time the computation
      self._elements[key] = element, dict(info, seconds=time.perf_counter() - start)
    return self._elements[key]

  def _learn(self, a: int, b: int, start: tuple[dict, dict]) -> tuple[dict, dict]:
    """The "learned" method: ``start``'s attention matrices in scope trained on the loss of
    the path's point at lambda (``matching.learn_alignment``), on batches of the training
    slice (``dataset.train_split``) of the data set the scope was fine-tuned on, the best
    iterate chosen on ``study.learn_holdout_batches`` batches of the validation slice. The
    test split is not read."""
    s = self.config.study
    sites = [n for n in matching.active_names(self.model.spec, self.scope_paths)
             if n in self.model.spec.attention]
    holdout = list(itertools.islice(inputs.validation_batches(self.config, self.dataset),
                                    s.learn_holdout_batches))
    batches = inputs.train_batches(self.config, self.dataset, seed=1000 * a + b)
    def progress(line):
      log.info("%s seed %d-%d learned: step %d/%d, train loss %.4f, held-out barrier %.4f "
               "(best %.4f), %.0f s", self.scope, a, b, line["step"], line["steps"],
               line["train_loss"], line["holdout_barrier"], line["best_holdout_barrier"],
               line["seconds"])
    return matching.learn_alignment(
        self.model.spec, self.params[a], self.params[b], start, sites=sites,
        loss_fn=_mean_loss(self.model), batches=batches, holdout_batches=holdout, steps=s.learn_steps,
        learning_rate=s.learn_learning_rate, lam="uniform" if s.learn_uniform_lambda else 0.5,
        key=jax.random.key(1000 * a + b), progress=progress)


  def pair(self, a: int, b: int) -> dict[str, Any]:
    methods = {}
    for method in self.config.study.methods:
      def compute(method=method):
        pa, aligned, info = self.align(a, b, method)
        return dict(curve_result(self.evaluator(pa, aligned, self.lams), self.lams), matching=info)
      methods[method] = self._cached(method, compute, a=a, b=b, method=method,
                                     **self._method_fields(method))
      log.info("%s seed %d-%d %-5s loss barrier %.4f accuracy barrier %.4f", self.scope, a, b,
                   method, methods[method]["loss_barrier"], methods[method]["accuracy_barrier"])
    return {"a": f"seed_{a}", "b": f"seed_{b}", "methods": methods}

  def permutation_ablation(self, a: int, b: int, naive: Mapping[str, float]) -> dict | None:
    """Every head permutation + Stage 2 on the first attention layer (the paper's Table 1).

    Runs for the "first_attention" scope, whose only symmetry is that layer's,
    when it has at most ``study.max_exhaustive_heads`` heads.
    """
    if self.scope != "first_attention" or not self.config.study.permutation_ablation:
      return None
    (site,) = self.scope_paths  # the model's first attention site
    if self.model.spec.attention[site].num_heads > self.config.study.max_exhaustive_heads:
      return None
    def compute():
      pa, pb = self.params[a], self.params[b]
      s = self.model.spec.attention[site]
      elements, info = matching.match_attention_exhaustive(
          subtree(pa, site), subtree(pb, site), group=s.group, rope_pairing=s.rope_pairing,
          rotary_fraction=s.rotary_fraction, rope_axes=s.rope_axes, method="full",
          **{k: v for k, v in self._matching_options("full").items() if k != "refine"})
      chosen = int(info["stage1_index"])
      identity = group_action.identity_model(self.model.spec)
      barriers = []
      for i in range(elements.perm.shape[0]):
        element = dict(identity, **{site: jax.tree.map(lambda v, i=i: v[i], elements)})
        aligned = self._apply(pb, element)
        barriers.append(curve_result(self.evaluator(pa, aligned, self.lams), self.lams))
      out = {"chosen": chosen, "num_permutations": len(barriers),
             "perms": np.asarray(info["perms"]).tolist()}
      for metric in ("loss", "accuracy"):
        values = [r[f"{metric}_barrier"] for r in barriers]
        rank, lhat = report.rank_and_lhat(values[chosen], values, naive[f"{metric}_barrier"])
        out |= {f"{metric}_barriers": values, f"{metric}_rank": rank, f"{metric}_lhat": lhat,
                f"{metric}_curves": [r[metric] for r in barriers]}
      return out
    options = {k: v for k, v in self._matching_options("full").items() if k != "refine"}
    return self._cached("ablation_permutations", compute, a=a, b=b, **_option_fields(options),
                        **{"stored": "barriers and curves of every permutation"})

  def distance_ablation(self, a: int, b: int) -> dict[str, dict]:
    """The full method under every Stage 1 distance, for the "first_attention" scope
    (as the paper's Appendix K)."""
    out = {}
    if self.scope != "first_attention":
      return out
    for distance in self.config.study.distances:
      def compute(distance=distance):
        pa, aligned, _ = self.align(a, b, "full", distance=distance)
        return curve_result(self.evaluator(pa, aligned, self.lams), self.lams)
      out[distance] = self._cached(
          f"ablation_distance_{distance}", compute, a=a, b=b,
          **_option_fields(self._matching_options("full", distance=distance), ["distance"]))
    return out

  def robustness(self, a: int, b: int) -> dict[str, list[float]]:
    """Accuracy of A, B and every method's midpoint at each noise level."""
    def compute():
      key = jax.random.key(self.config.seed)
      ends = np.array([0.0, 0.5, 1.0])
      out: dict[str, list[float]] = {"A": [], "B": []}
      for method in self.config.study.methods:
        pa, aligned, _ = self.align(a, b, method)
        out[f"midpoint ({method})"] = []
        for level in self.config.study.noise_levels:
          batches = noisy(self.evaluator.batches, level, key=key, input_key=self.model.input_key,
                          vocab_size=getattr(self.model.config, "vocab_size", None))
          acc = self.evaluator(pa, aligned, ends, batches)["accuracy"]
          out[f"midpoint ({method})"].append(acc[1])
          if method == "naive":
            out["A"].append(acc[0])
            out["B"].append(acc[2])
      return out
    options = {}
    for m in self.config.study.methods:
      options.update(self._method_fields(m))
    return self._cached("robustness", compute, a=a, b=b, **options,
                        **fingerprints.config_fields(
                            self.config, ("seed", "study.noise_levels", "study.methods")))

  def run(self) -> dict[str, Any]:
    pairs, ablations, distances, robust = [], [], {d: [] for d in self.config.study.distances}, []
    endpoints = {}
    for a, b in itertools.combinations(self.seeds, 2):
      entry = self.pair(a, b)
      pairs.append(entry)
      naive = entry["methods"]["naive"]
      for seed, i in ((a, 0), (b, -1)):  # the naive path's ends are the checkpoints themselves
        endpoints[f"seed_{seed}"] = {"loss": naive["loss"][i], "accuracy": naive["accuracy"][i]}
      abl = self.permutation_ablation(a, b, entry["methods"]["naive"])
      if abl is not None:
        ablations.append(abl)
      for d, res in self.distance_ablation(a, b).items():
        distances[d].append({"methods": {"naive": entry["methods"]["naive"], "full": res}})
      if self.config.study.noise_levels:
        robust.append(self.robustness(a, b))
    result: dict[str, Any] = {
        "scope": self.scope, "scope_paths": self.scope_paths, "lambdas": self.lams.tolist(),
        "loss_unit": "bits per byte" if self.evaluator.bits_per_byte else "cross-entropy (nats)",
        "endpoints": endpoints, "pairs": pairs,
        "methods": report.summarise_methods(pairs), "ablation": {}}
    if ablations:
      result["ablation"]["permutations"] = {
          "num_permutations": ablations[0]["num_permutations"], "per_pair": ablations,
          "summary": report.summarise_permutation_ablation(ablations)}
    if any(distances.values()):
      result["ablation"]["distances"] = {d: report.summarise_methods(v)["full"]
                                         for d, v in distances.items() if v}
    if robust:
      models = list(robust[0])
      result["robustness"] = {
          "noise_levels": list(self.config.study.noise_levels), "models": models,
          "accuracy": {m: np.mean([r[m] for r in robust], axis=0).tolist() for m in models}}
    return result


def _jsonable(tree: Any) -> Any:
  if isinstance(tree, Mapping):
    return {str(k): _jsonable(v) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    return [_jsonable(v) for v in tree]
  if isinstance(tree, (jax.Array, np.ndarray, np.generic)):
    arr = np.asarray(tree)
    return arr.item() if arr.ndim == 0 else arr.tolist()
  return tree


# ----------------------------------------------------------------------------- the whole study


def first_examples(batches: Iterable[Mapping[str, np.ndarray]], limit: int
                   ) -> list[dict[str, np.ndarray]]:
  """The batches that hold the first ``limit`` valid examples (every batch for 0), with
  ``valid`` False past them: a fixed subset of the test split, in its stored order
  (this process's share of it when several processes read)."""
  out, seen = [], 0
  for batch in batches:
    if limit and seen >= limit:
      break
    batch = dict(batch)
    valid = np.asarray(batch["valid"], bool)
    if limit:
      valid = valid & (np.cumsum(valid) + seen <= limit)
    seen += int(valid.sum())
    out.append({**batch, "valid": valid})
  return out


def examples_digest(batches: Iterable[Mapping[str, np.ndarray]]) -> str:
  """Content hash of the evaluation examples (the rows whose "valid" is set), the same
  whatever ``train.eval_batch_size`` cut them into."""
  rows: dict[str, list[np.ndarray]] = {}
  for batch in batches:
    valid = np.asarray(batch["valid"], bool) if "valid" in batch else slice(None)
    for k, v in batch.items():
      if k != "valid":
        rows.setdefault(k, []).append(np.asarray(v)[valid])
  return fingerprints.tree_digest({k: np.concatenate(v) for k, v in rows.items()})


class Reports:
  """The report files under ``study/``, each rewritten only when what it is drawn from changed.

  ``study/report_fingerprints.json`` maps each report (path relative to
  ``study/``) to the fingerprint of its inputs (the results and title it is
  drawn from); a report whose file exists with the same fingerprint is kept.
  """

  def __init__(self, directory: str):
    self.directory = directory
    self._path = os.path.join(directory, "report_fingerprints.json")
    saved = atomic_io.read_json_or_none(self._path, "report fingerprints")
    self._saved = saved if isinstance(saved, dict) else {}
    self.written: list[str] = []

  def write(self, name: str, drawn_from: Any, write: Callable[[str], Any]) -> str:
    """``write(path)`` for report ``name`` unless it is up to date; returns its path."""
    path = os.path.join(self.directory, name)
    fp = fingerprints.key({"report": name, "drawn_from": drawn_from})
    if self._saved.get(name) != fp or not os.path.exists(path):
      write(path)
      self._saved[name] = fp
      atomic_io.write_json(self._path, self._saved, indent=1, sort_keys=True)
      self.written.append(name)
    return path


def run_study(config: ml_collections.ConfigDict, workdir: str) -> dict[str, str]:
  """Runs (or resumes) the study of every re-initialisation scope; returns the report paths.

  Raises:
    ValueError: a bad study config, a scope with nothing to align, or
      checkpoints that are missing, unfinished or trained with other fields
      (``train.load_checkpoints``), before any work.
    checkpoints.CorruptCheckpointError: a damaged endpoint (one line naming it).
  """
  config_checks.validate(config)
  if not config.reinit.scopes:
    log.info("config.reinit.scopes is empty: no study to run")
    return {}
  model = inputs.create_model(config)
  check_scopes(config, model)
  checkpoints = train.load_checkpoints(config, workdir, require_complete=True)
  dataset = config.reinit.dataset or config.dataset.name
  batches = first_examples(inputs.eval_batches(config, dataset), config.study.eval_examples)
  data_fp = fingerprints.key({"dataset": dataset, "examples": examples_digest(batches)})
  info = inputs.dataset_info(config, dataset)
  evaluator = PathEvaluator(model, batches, chunk_size=config.study.lambda_chunk,
                            bits_per_byte=model.task == tasks.LM and info.byte_level)
  reports = Reports(os.path.join(workdir, "study"))
  paths, results = {}, {}
  for scope in config.reinit.scopes:
    study = ScopeStudy(config, model, scope, checkpoints, evaluator, workdir, data_fp)
    start = time.perf_counter()
    res = study.run()
    log.info("study of scope %s: %d stage(s) computed, %d reused, %.1fs", scope, study.computed,
             study.reused, time.perf_counter() - start)
    results[scope] = res
    paths[f"{scope}/results.json"] = reports.write(
        f"{scope}/results.json", res, lambda p, res=res: atomic_io.write_json(p, res, indent=1))
    title = f"{config.model.family} on {dataset}: re-initialised {scope}"
    loss_name = f"test loss ({res['loss_unit']})"
    paths[f"{scope}/curves.png"] = reports.write(
        f"{scope}/curves.png", [title, loss_name, res["lambdas"], res["pairs"]],
        lambda p, res=res, title=title, loss_name=loss_name: report.plot_curves(
            p, title, res["lambdas"], res["pairs"], loss_name=loss_name))
    if "permutations" in res["ablation"]:
      per_pair = res["ablation"]["permutations"]["per_pair"]
      naive = [p["methods"]["naive"]["loss"] for p in res["pairs"]]
      perm_title = (f"{title}: the path after each of the "
                    f"{per_pair[0]['num_permutations']} head permutations + Stage 2")
      paths[f"{scope}/ablation_permutations.png"] = reports.write(
          f"{scope}/ablation_permutations.png", [perm_title, loss_name, res["lambdas"], per_pair,
                                                 naive],
          lambda p, per_pair=per_pair, naive=naive, perm_title=perm_title, loss_name=loss_name,
          res=res: report.plot_permutation_curves(p, perm_title, res["lambdas"], per_pair, naive,
                                                  loss_name=loss_name))
  title = f"LMC study: {config.model.family} on {dataset}"
  paths["summary.md"] = reports.write(
      "summary.md", [title, results],
      lambda p: atomic_io.write_text(p, report.markdown_summary(title, results)))
  if reports.written:
    log.info("study reports written: %s", ", ".join(reports.written))
  return paths
