"""The study of one re-initialisation scope: per-pair measurements and the scope's result.

``ScopeStudy`` aligns every pair (A, B) of the scope's re-initialised seeds with
each matching method (``matching.align_model`` restricted to the scope's
parameter prefixes, with the inputs the method needs: ``ScopeStudy._provide``), keeps each
alignment for the rest of the run, and measures, per pair and stage, each
result kept by ``result_cache.cached`` under ``workdir/study/<scope>/pairs/``:

* the interpolation path of every method (``path_evaluation``) and its barriers, and with
  ``study.repair`` the same path with every interior point REPAIRed (``attn_symmetry.repair``,
  reported as the method "<method>+repair"); with ``study.circuit_path`` the method's aligned
  pair on the circuit path too (``attn_symmetry.circuit_path``, a comparison measure,
  reported in the method's entry as "circuit");
* for the "first_attention" scope: Stage 2 after every head permutation (the
  paper's Table 1 ablation) and the full method under every Stage 1 distance;
* the accuracy of the endpoints and of each method's midpoint under input
  noise (``input_noise``).

Each stage is keyed by the config fields it reads, as ``experiments/setting/config_schema.py``
says field by field (``Field.study``, ``Field.option``): ``method_keys`` and
``config_schema.study_keyed`` derive them; ``fingerprints.py`` lists them.

``ScopeStudy.run`` assembles them into the scope's result: per-pair curves,
means and ratios to naive (``report.summarise_methods``), the ablations'
summaries and the robustness table.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np

from attn_symmetry import group_action
from attn_symmetry import lmc
from attn_symmetry import matching
from attn_symmetry import repair
from attn_symmetry import runtime
from attn_symmetry import tasks
from attn_symmetry.spec import SymmetrySpec, subtree
from experiments.report import report
from experiments.setting import config_schema
from experiments.setting import fingerprints
from experiments.study import input_noise
from experiments.study import path_evaluation
from experiments.study import result_cache
from experiments.train import evaluation
from experiments.train import inputs
from experiments.train import reinit

Params = dict[str, Any]
log = logging.getLogger(__name__)
log.setLevel(logging.INFO)


# What every stage keys and what the stages of each method key, by config field, derive from
# experiments/setting/config_schema.py: each field names the stages that read it (``Field.study``)
# or the align_model option it sets (``Field.option``).


def method_keys(method: str, options: Iterable[str] | None = None) -> tuple[str, ...]:
  """The config fields that a stage computing ``method`` keys: those of the ``align_model``
  ``options`` it is run with (``matching.METHODS[method].options`` by default) and those
  that the study reads to supply every input it may need (``Method.every_input``: the data
  it learns from, the batches whose activations it reads)."""
  m = matching.METHODS[method]
  fields = config_schema.option_fields()
  readers = (f for needed in m.every_input for f in config_schema.study_keyed(needed))
  options = m.options if options is None else options
  return tuple(dict.fromkeys((*(fields[option] for option in options), *readers)))


def option_values(config: ml_collections.ConfigDict, options: Iterable[str],
                  **changes) -> dict[str, Any]:
  """{option: value} of ``align_model``'s ``options``, each from the config field that sets
  it (``config_schema.option_fields``; a list as a tuple) unless ``changes`` gives it; only
  those fields are read."""
  fields, out = config_schema.option_fields(), {}
  for option in options:
    value = changes[option] if option in changes else config_schema.value(config, fields[option])
    out[option] = tuple(value) if isinstance(value, list) else value
  return out


def learned_overlap(config: ml_collections.ConfigDict, dataset: str) -> dict[str, str]:
  """{field: split} of the slices of ``dataset`` that the methods that train on a loss read
  (``matching.LOSS``: ``dataset.train_split``, which they train on, and
  ``dataset.validation_split``, on which they pick their best iterate) and that share records
  with ``study.eval_split``: on those records their barrier is not held out. Empty when no
  compared method trains on a loss.

  Raises:
    ValueError: naming the config field of a split that ``dataset`` lacks.
  """
  if not any(matching.LOSS in matching.METHODS[m].needs(matching_kwargs(config, m))
             for m in config.study.methods):
    return {}
  evaluated = inputs.split_range(config, "study.eval_split", dataset)
  out = {}
  for field in ("dataset.train_split", "dataset.validation_split"):
    split = config.dataset[field.split(".")[1]]
    if split and inputs.shared_records(evaluated, inputs.split_range(config, field, dataset)):
      out[field] = split
  return out


def factors_in_scope(spec: SymmetrySpec, names: Sequence[str], wanted: Sequence[str]) -> tuple[str, ...]:
  """The factors of ``wanted`` (``study.learn_factors``) that ``names`` (a scope's
  ``matching.active_names``) have a symmetry for, in ``wanted``'s order: one list serves
  every scope of a study (the first attention layer has no FFN factor, say)."""
  has = matching.learned_factors(spec, names, None)
  return tuple(f for f in wanted if f in has)


def matching_kwargs(config: ml_collections.ConfigDict, method: str = "full",
                    **changes) -> dict[str, Any]:
  """The keyword arguments of ``matching.align_model`` that ``method`` uses
  (``matching.METHODS[method].options``), from the config (``option_values``), with
  ``changes`` applied."""
  return option_values(config, matching.METHODS[method].options, **changes)


# The options of the Stage 1 ablation over every head order (``matching.
# match_attention_exhaustive``): the "full" method's, but the refinement schedule and the
# residual factor, which one attention layer does not have.
_EXHAUSTIVE_OPTIONS = tuple(o for o in matching.METHODS["full"].options
                            if o not in ("refine", "residual"))


REPAIRED = report.REPAIRED  # the suffix of a method's REPAIRed path in the results


def repaired(method: str) -> str:
  """The name of ``method``'s REPAIRed path in the results: "full+repair"."""
  return method + REPAIRED


def circuit_stage(method: str) -> str:
  """The name of the stage of ``method``'s circuit path: "full+circuit" (its result is the
  method's entry "circuit", ``report.CIRCUIT``)."""
  return f"{method}+{report.CIRCUIT}"


# What a circuit stage evaluates (a field of its key).
_CIRCUIT_PATH = "each head's circuits interpolated (attn_symmetry.circuit_path)"


# How a path's endpoints are measured (``ScopeStudy._path``): a stage result computed
# otherwise (every lambda evaluated on its own path) is recomputed.
_ENDPOINTS = "each seed's own model, evaluated once"


def element_spec(config: ml_collections.ConfigDict, model, names: Sequence[str]
                 ) -> SymmetrySpec:
  """The spec that the descent's elements of this scope belong to: ``model.spec``, or with
  ``study.match_residual`` "orthogonal" and a pre-LayerNorm stream in the scope,
  ``matching.residual_spec`` (its O(d - 1) factor; the model's head untied by
  ``study.run_study``); ``names`` the scope's (``matching.active_names``).

  Raises:
    ValueError: "orthogonal" for a model whose stream cannot take it (a post-LayerNorm BERT),
      naming the field.
  """
  if (config.study.match_residual == "permutation"
      or not any(f in names for f in model.spec.factors if f.startswith("residual"))):
    return model.spec
  try:
    return matching.residual_spec(model.spec, config.study.match_residual, names)
  except ValueError as e:
    raise ValueError(f"study.match_residual {config.study.match_residual!r}: {e}") from None


def identity_closeness(element: Mapping[str, Any], identity: Mapping[str, Any]
                       ) -> dict[str, dict[str, float]]:
  """How near an alignment element is to the identity, leaf by leaf.

  Args:
    element: the element that matching returned (``group_action.ModelElement``).
    identity: ``group_action.identity_model`` of the same spec.

  Returns:
    {"fixed_points": {leaf: the fraction of the permutation's entries it leaves in place,
    1 at the identity, about 1/n for a random permutation of n}, "relative_distance":
    {leaf: ||g - I||_F / ||I||_F of a matrix leaf, 0 at the identity, about sqrt(2) for a
    random orthogonal matrix}}, leaves named by their path in the element ("['residual']").
    Leaves the identity lacks, or of another shape, are left out.
  """
  ident = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(
      dict(identity))[0]}
  out: dict[str, dict[str, float]] = {"fixed_points": {}, "relative_distance": {}}
  for path, g in jax.tree_util.tree_flatten_with_path(dict(element))[0]:
    name = jax.tree_util.keystr(path)
    g, i = np.asarray(g), np.asarray(ident.get(name, np.zeros(0)))
    if g.shape != i.shape or not g.size:
      continue
    if np.issubdtype(g.dtype, np.integer):
      out["fixed_points"][name] = float(np.mean(g == i))
    else:
      i = i.astype(np.float64)
      out["relative_distance"][name] = float(np.linalg.norm(g - i) / np.linalg.norm(i))
  return out


class ScopeStudy:
  """The study of one re-initialisation scope."""

  def __init__(self, config, model, scope: str, checkpoints: Mapping[str, Params],
               evaluator: path_evaluation.PathEvaluator | None, workdir: str,
               data_fingerprint: str):
    self.config, self.model, self.scope = config, model, scope
    self.evaluator = evaluator
    self.dir = os.path.join(workdir, "study", scope)
    self.scope_paths = reinit.scope_paths(model, scope)
    self.names = matching.active_names(model.spec, self.scope_paths)
    self.element_spec = element_spec(config, model, self.names)
    self.learned_overlap = learned_overlap(config, self.dataset)
    self.seeds = list(config.reinit.seeds)
    self.params = {s: checkpoints[f"reinit/{scope}/seed_{s}"] for s in self.seeds}
    self.digests = {s: fingerprints.tree_digest(p) for s, p in self.params.items()}
    self.data_fingerprint = data_fingerprint
    # "perm" and "ortho" run with the "full" method's options too, which change nothing in
    # their element but let the three share one compiled program (``matching.align_model``).
    self._program_options = matching_kwargs(config, "full")
    self.reused = 0
    self.computed = 0
    self._announced: set[str] = set()
    self._alignments: dict[tuple, tuple[Params, Params, dict]] = {}
    self._elements: dict[tuple, tuple[dict, dict]] = {}
    self._ends: dict[int, dict[str, list[float]]] = {}  # by seed: its loss and accuracy
    self._activation_data: dict[int, list[dict[str, Any]]] = {}  # by count: the batches
    # g.theta compiled once: the ablation applies one element per head permutation.
    self._apply = (path_evaluation.compiled(model)[1] if self.element_spec is model.spec else
                   jax.jit(functools.partial(group_action.apply_model, self.element_spec)))

  @property
  def dataset(self) -> str:
    """The data set the scope was fine-tuned on: ``reinit.dataset``, or the base data set."""
    return self.config.reinit.dataset or self.config.dataset.name

  @property
  def lams(self) -> np.ndarray:
    """The ``study.num_lambdas`` interpolation points of every path."""
    return lmc.lambdas(self.config.study.num_lambdas)

  def _cached(self, name: str, compute: Callable[[], dict], *, a: int, b: int,
              keyed: Iterable[str] = (), **fields) -> dict:
    """``result_cache.cached`` result of one stage of pair (a, b).

    Its fields (``fingerprints.py``): the scope's parameter paths, the config fields
    that every stage reads (``config_schema.study_keyed(EVERY_STAGE)``: the model, the
    number of lambdas and evaluation examples, the evaluation split), the content hashes
    of both checkpoints and of the evaluation data, the config fields ``keyed`` that this
    stage reads besides, and its own ``fields``. The first stage of this scope
    recomputed for a given change logs it.
    """
    keyed = (*config_schema.study_keyed(config_schema.EVERY_STAGE), *keyed)
    fields = {"scope paths": list(self.scope_paths), "path endpoints": _ENDPOINTS,
              **fingerprints.config_fields(self.config, keyed),
              fingerprints.INPUT + "evaluation data": self.data_fingerprint,
              fingerprints.INPUT + f"seed_{a} params": self.digests[a],
              fingerprints.INPUT + f"seed_{b} params": self.digests[b], **fields}
    start = time.perf_counter()
    path = os.path.join(self.dir, f"pairs/seed_{a}-seed_{b}", name + ".json")
    result, why = result_cache.cached(path, fields, compute)
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

  def _path(self, a: int, b: int, theta_a: Params, aligned_b: Params,
            interior: Callable[[np.ndarray], dict[str, list[float]]] | None = None
            ) -> dict[str, Any]:
    """``path_evaluation.curve_result`` of the path from ``theta_a`` to ``aligned_b``.

    Only the interior lambdas are evaluated (by ``interior(lams)``; default: the models
    (1 - lam) theta_A + lam aligned_B): every path of pair (a, b) starts at a
    model that computes theta_A's function and ends at one that computes theta_B's
    (g.theta_B is theta_B under a symmetry, and folding norm scales keeps a model's
    function), so the endpoints' loss and accuracy are theta_A's and theta_B's,
    each seed's evaluated once. This saves 2 of ``study.num_lambdas`` points on each
    of the pair's paths (30 with the 24-permutation ablation).
    """
    for seed in (a, b):
      if seed not in self._ends:
        self._ends[seed] = self.evaluator(self.params[seed], self.params[seed], self.lams[:1])
    start, end = self._ends[a], self._ends[b]
    if interior is None:
      interior = lambda lams: self.evaluator(theta_a, aligned_b, lams)
    inside = interior(self.lams[1:-1]) if len(self.lams) > 2 else {k: [] for k in start}
    curve = {k: [*start[k], *inside[k], *end[k]] for k in start}
    return path_evaluation.curve_result(curve, self.lams)

  def _activation_batches(self) -> list[dict[str, Any]]:
    """The first ``study.activation_batches`` batches of the training slice of the scope's data
    set (not augmented), as the model reads them: the activations that REPAIR and activation
    matching measure, never the evaluation set."""
    count = self.config.study.activation_batches
    if count not in self._activation_data:
      batches = inputs.train_batches(self.config, self.dataset, seed=0, whole=True,
                                     augment=False)
      self._activation_data[count] = [evaluation.model_inputs(self.model, b)
                                  for b in itertools.islice(batches, count)]
    return self._activation_data[count]

  def _repaired_path(self, a: int, b: int, theta_a: Params, aligned_b: Params
                     ) -> dict[str, Any]:
    """``_path`` with each interior point REPAIRed (``repair.repair`` at its lambda, on
    ``_activation_batches``, the endpoints' statistics measured once, with
    ``study.repair_no_bias``'s rule); the endpoints are the seeds' own models, as REPAIR at
    lambda 0 and 1 computes them. Adds "repair": "no_bias" (the rule) and, per lambda, the
    channels REPAIR corrected and those it left as they were (degenerate), summed over the
    points, and "gaps": {point: {"mean_gap", "scale_gap"}}, what REPAIR left of each point's
    targets (``repair.repair``'s info)."""
    points, counts = set(), []
    no_bias = self.config.study.repair_no_bias

    def repaired_points(lams: np.ndarray) -> dict[str, list[float]]:
      out: dict[str, list[float]] = {"loss": [], "accuracy": []}
      batches = self._activation_batches()
      endpoints = repair.endpoint_statistics(self.model, theta_a, aligned_b, batches)
      for lam in lams:
        params, info = repair.repair(self.model, theta_a, aligned_b, float(lam), batches,
                                     endpoints=endpoints, no_bias=no_bias)
        for k, v in self.evaluator(params, params, self.lams[:1]).items():
          out[k] += v
        points.update(info)
        counts.append({k: int(sum(p[k] for p in info.values()))
                       for k in ("channels", "corrected", "degenerate")}
                      | {"gaps": {name: {k: p[k] for k in repair.GAPS}
                                  for name, p in info.items()}})
      return out

    path = self._path(a, b, theta_a, aligned_b, interior=repaired_points)
    return dict(path, repair={"points": sorted(points), "no_bias": no_bias,
                              "per_lambda": counts})

  def _circuit_path(self, a: int, b: int, method: str) -> dict[str, Any]:
    """``_path`` on the circuit path from theta_A to ``method``'s g.theta_B
    (``path_evaluation.PathEvaluator.circuits``): the same ends, the seeds' own models, as the
    circuit path's ends compute them. Stage ``circuit_stage(method)``, keyed by the method's
    fields."""
    def compute():
      pa, aligned, _ = self.align(a, b, method)
      evaluator = self.evaluator.circuits()
      return self._path(a, b, pa, aligned, interior=lambda lams: evaluator(pa, aligned, lams))
    return self._cached(circuit_stage(method), compute, a=a, b=b, keyed=method_keys(method),
                        method=method, path=_CIRCUIT_PATH)

  def _matching_options(self, method: str, **overrides) -> dict[str, Any]:
    """``matching_kwargs`` of ``method``, a study-wide ``factors`` list narrowed to the factors
    that this scope has (``factors_in_scope``: the first attention layer has no FFN factor).

    Raises:
      ValueError: the scope has none of them, naming ``study.learn_factors``.
    """
    options = matching_kwargs(self.config, method, **overrides)
    if self.element_spec is self.model.spec and "residual" in options:
      options["residual"] = "permutation"  # no LayerNorm stream in this scope to rotate
    if "factors" in options:
      options["factors"] = factors_in_scope(self.model.spec, self.names, options["factors"])
      if not options["factors"]:
        raise ValueError(f"scope {self.scope!r} has none of the factors of "
                         f"study.learn_factors {list(self.config.study.learn_factors)}, which "
                         f"method {method!r} trains")
    return options

  def align(self, a: int, b: int, method: str, **overrides) -> tuple[Params, Params, dict]:
    """(theta_A, g.theta_B, matching info): B aligned to A in this scope.

    When the alignment maps an orthogonal residual factor, both endpoints are
    returned in ``group_action.canonical_form`` (norm scales folded; for the O(d - 1)
    residual also the writers' means and the gains), which keeps each model's function, so
    the path joins like with like.
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
    info = runtime.jsonable(dict(info, identity=identity_closeness(
        element, group_action.identity_model(self.element_spec))))
    if info.get("folded_norm_scales"):  # RMSNorm gains folded; the O(d - 1) residual's gauges
      pa, pb = (group_action.canonical_form(self.element_spec, p) for p in (pa, pb))
    return pa, self._apply(pb, element), info

  def _element(self, a: int, b: int, method: str, options: dict[str, Any]):
    """(element, info) of ``method`` for pair (a, b): ``matching.align_model``, built-in and
    registered methods alike, with the inputs the method needs (``_provide``), kept for the
    rest of the run."""
    key = (a, b, method, json.dumps(options, sort_keys=True))
    if key not in self._elements:
      start = time.perf_counter()
      if method in matching.STAGES:  # with "full"'s options too: one program for the three
        options = {**self._program_options, **options}
      data = matching.provided_arguments(method, options,
                                         lambda needed: self._provide(a, b, method, needed))
      element, info = matching.align_model(self.model.spec, self.params[a], self.params[b],
                                           scope=self.scope_paths, method=method, **options,
                                           **data)
      jax.block_until_ready(element)  # dispatch is asynchronous: time the computation
      self._elements[key] = element, dict(info, seconds=time.perf_counter() - start)
    return self._elements[key]

  def _provide(self, a: int, b: int, method: str, needed: str) -> dict[str, Any]:
    """The arguments of input ``needed`` (``matching.INPUTS``) that ``method`` needs for pair
    (a, b).

    ``ACTIVATIONS``: ``Model.batch_activations`` on ``_activation_batches``. ``LOSS``: the
    loss of a path's point (``path_evaluation.mean_loss``) on batches of the training slice
    (``dataset.train_split``) of the data set the scope was fine-tuned on, in an order of the
    pair's own; the held-out batches of its validation slice; a key of the pair's own; a
    progress line in the log. The evaluation examples are not read, unless
    ``study.eval_split`` shares records with these slices (``learned_overlap``, which the
    result records and summary.md reports). ``REPAIR``: the model, what it reads of a
    training batch (``path_evaluation.model_inputs``) and ``study.repair_no_bias``'s rule, the
    one that the REPAIRed paths (``study.repair``) use.
    """
    if needed == matching.ACTIVATIONS:
      return dict(activations=self.model.batch_activations,
                  match_batches=self._activation_batches())
    if needed == matching.REPAIR:
      return dict(model=self.model, model_inputs=path_evaluation.model_inputs(self.model),
                  repair_no_bias=self.config.study.repair_no_bias)

    def progress(line):
      log.info("%s seed %d-%d %s: step %d/%d, train loss %.4f, held-out barrier %.4f "
               "(best %.4f), %.0f s", self.scope, a, b, method, line["step"], line["steps"],
               line["train_loss"], line["holdout_barrier"], line["best_holdout_barrier"],
               line["seconds"])

    return dict(loss_fn=path_evaluation.mean_loss(self.model),
                batches=inputs.train_batches(self.config, self.dataset, seed=1000 * a + b,
                                             whole=True),
                holdout_batches=inputs.validation_batches(self.config, self.dataset, whole=True),
                key=jax.random.key(1000 * a + b), progress=progress)

  def pair(self, a: int, b: int) -> dict[str, Any]:
    """Every method's path of pair (a, b), with ``study.circuit_path`` its circuit path in its
    entry ("circuit"), and with ``study.repair`` every method's REPAIRed path ("<method>+repair"
    in ``REPAIRED``)."""
    methods = {}
    for method in self.config.study.methods:
      def compute(method=method):
        pa, aligned, info = self.align(a, b, method)
        return dict(self._path(a, b, pa, aligned), matching=info)
      methods[method] = self._cached(method, compute, a=a, b=b, keyed=method_keys(method),
                                     method=method)
      if self.config.study.circuit_path:
        methods[method] = dict(methods[method],
                               **{report.CIRCUIT: self._circuit_path(a, b, method)})
      if self.config.study.repair:
        def compute_repaired(method=method):
          return self._repaired_path(a, b, *self.align(a, b, method)[:2])
        methods[repaired(method)] = self._cached(
            repaired(method), compute_repaired, a=a, b=b,
            keyed=(*method_keys(method), *config_schema.study_keyed(config_schema.REPAIR)),
            method=method, repair="every interior point, " + ", ".join(repair.POINTS))
    for method, m in methods.items():
      log.info("%s seed %d-%d %-5s loss barrier %.4f accuracy barrier %.4f", self.scope, a, b,
               method, m["loss_barrier"], m["accuracy_barrier"])
      if report.CIRCUIT in m:
        log.info("%s seed %d-%d %-5s circuit path (comparison): loss barrier %.4f", self.scope,
                 a, b, method, m[report.CIRCUIT]["loss_barrier"])
    return {"a": f"seed_{a}", "b": f"seed_{b}", "methods": methods}

  def permutation_ablation(self, a: int, b: int, naive: Mapping[str, float]) -> dict | None:
    """Every head permutation + Stage 2 on the first attention layer (the paper's Table 1).

    Runs for the "first_attention" scope, whose only symmetry is that layer's,
    when it has at most ``study.max_exhaustive_heads`` heads, on the pairs of
    ``study.permutation_ablation_seeds`` (every pair when empty).
    """
    subset = set(self.config.study.permutation_ablation_seeds)
    if (self.scope != "first_attention" or not self.config.study.permutation_ablation
        or (subset and not {a, b} <= subset)):
      return None
    (site,) = self.scope_paths  # the model's first attention site
    if self.model.spec.attention[site].num_heads > self.config.study.max_exhaustive_heads:
      return None
    def compute():
      pa, pb = self.params[a], self.params[b]
      elements, info = matching.match_attention_exhaustive(
          subtree(pa, site), subtree(pb, site), self.model.spec.attention[site], method="full",
          **option_values(self.config, _EXHAUSTIVE_OPTIONS))
      chosen = int(info["stage1_index"])
      identity = group_action.identity_model(self.model.spec)
      barriers = []
      for i in range(elements.perm.shape[0]):
        element = dict(identity, **{site: jax.tree.map(lambda v, i=i: v[i], elements)})
        aligned = self._apply(pb, element)
        barriers.append(self._path(a, b, pa, aligned))
      out = {"chosen": chosen, "num_permutations": len(barriers),
             "perms": np.asarray(info["perms"]).tolist()}
      for metric in ("loss", "accuracy"):
        values = [r[f"{metric}_barrier"] for r in barriers]
        rank, lhat = report.rank_and_lhat(values[chosen], values, naive[f"{metric}_barrier"])
        out |= {f"{metric}_barriers": values, f"{metric}_rank": rank, f"{metric}_lhat": lhat,
                f"{metric}_curves": [r[metric] for r in barriers]}
      return out
    return self._cached("ablation_permutations", compute, a=a, b=b,
                        keyed=method_keys("full", _EXHAUSTIVE_OPTIONS),
                        stored="barriers and curves of every permutation")

  def distance_ablation(self, a: int, b: int) -> dict[str, dict]:
    """The full method under every Stage 1 distance, for the "first_attention" scope
    (as the paper's Appendix K)."""
    out = {}
    if self.scope != "first_attention":
      return out
    for distance in self.config.study.distances:
      def compute(distance=distance):
        pa, aligned, _ = self.align(a, b, "full", distance=distance)
        return self._path(a, b, pa, aligned)
      others = [o for o in matching.METHODS["full"].options if o != "distance"]
      out[distance] = self._cached(f"ablation_distance_{distance}", compute, a=a, b=b,
                                   keyed=method_keys("full", others),
                                   **{"ablation distance": distance})
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
          batches = input_noise.noisy(self.evaluator.batches, level, key=key, input_key=self.model.input_key,
                          vocab_size=getattr(self.model.config, "vocab_size", None))
          acc = self.evaluator(pa, aligned, ends, batches)["accuracy"]
          out[f"midpoint ({method})"].append(acc[1])
          if method == "naive":
            out["A"].append(acc[0])
            out["B"].append(acc[2])
      return out
    keyed = [name for m in self.config.study.methods for name in method_keys(m)]
    keyed += config_schema.study_keyed(config_schema.ROBUSTNESS)
    return self._cached("robustness", compute, a=a, b=b, keyed=keyed)

  def _loss_unit(self) -> str:
    if not self.evaluator.bits_per_byte:
      return "cross-entropy (nats)"
    return "bits per hidden byte" if self.model.task == tasks.MLM else "bits per byte"

  def run(self) -> dict[str, Any]:
    """Every pair's measurements (each reused from its cache file when unchanged), assembled
    into the scope's result (the ``study/<scope>/results.json`` that reports are drawn from)."""
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
        ablations.append({"a": entry["a"], "b": entry["b"], **abl})
      for d, res in self.distance_ablation(a, b).items():
        distances[d].append({"a": entry["a"], "b": entry["b"],
                             "methods": {"naive": entry["methods"]["naive"], "full": res}})
      if self.config.study.noise_levels:
        robust.append(self.robustness(a, b))
    result: dict[str, Any] = {
        "scope": self.scope, "scope_paths": self.scope_paths, "lambdas": self.lams.tolist(),
        "loss_unit": self._loss_unit(),
        "eval_split": self.config.study.eval_split,
        "eval_examples": sum(int(np.sum(b["valid"])) for b in self.evaluator.batches),
        "learned_overlap": self.learned_overlap,
        **({report.CIRCUIT_PATH: report.CIRCUIT_NOTE} if self.config.study.circuit_path else {}),
        "endpoints": endpoints, "pairs": pairs,
        **report.pair_statistics(pairs), "ablation": {}}
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
