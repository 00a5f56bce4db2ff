"""Loss and accuracy along interpolation paths on a fixed evaluation set.

``evaluation_examples`` fixes the evaluation set (a prefix of
``study.eval_split``, the test split by default), ``examples_digest`` hashes
it, and ``PathEvaluator`` evaluates the path
theta(lambda) = (1 - lambda) theta_A + lambda theta_B on it with one compiled
function per model config (``lmc.path_evaluator``), or, as ``circuits()``, the
circuit path (``attn_symmetry.circuit_path``, ``study.circuit_path``).
``curve_result`` adds the barriers of a curve.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import ml_collections
import numpy as np

from attn_symmetry import circuit_path
from attn_symmetry import group_action
from attn_symmetry import lmc
from attn_symmetry import models
from experiments.setting import fingerprints
from experiments.train import evaluation
from experiments.train import inputs

Params = dict[str, Any]

_COMPILED: dict[Any, tuple[Callable, Callable]] = {}


def compiled(model) -> tuple[Callable, Callable]:
  """(``lmc.path_evaluator`` of the model's metrics, jitted ``apply_model`` of its spec),
  made once per model config in this process, so that a study run again in the same
  process (a notebook, the tests) reuses their compilations."""
  if model.config not in _COMPILED:
    _COMPILED[model.config] = (
        lmc.path_evaluator(lambda p, b: evaluation.batch_metrics(model, p, b)),
        jax.jit(functools.partial(group_action.apply_model, model.spec)))
  return _COMPILED[model.config]


_CIRCUITS: dict[Any, Callable] = {}


def compiled_circuits(model) -> Callable:
  """``circuit_path.path_evaluator`` of the model's metrics, which reads each point with the
  model of twice the head width (``models.circuit_model``), made once per model config in this
  process (as ``compiled``).

  Raises:
    ValueError: a model that the circuit path does not apply to (RoPE).
  """
  if model.config not in _CIRCUITS:
    wide = models.circuit_model(model)
    _CIRCUITS[model.config] = circuit_path.path_evaluator(
        model.spec, lambda p, b: evaluation.batch_metrics(wide, p, b))
  return _CIRCUITS[model.config]


_LOSSES: dict[Any, Callable] = {}


def mean_loss(model) -> Callable[[Params, Mapping[str, Any]], jax.Array]:
  """loss(params, batch): the mean cross-entropy of a batch, one function object per model
  config (``matching.learn_alignment`` compiles once per loss function)."""
  if model.config not in _LOSSES:
    def loss(params, batch):
      sums = evaluation.batch_metrics(model, params, batch)
      return sums["loss"] / sums["count"]
    _LOSSES[model.config] = loss
  return _LOSSES[model.config]


_MODEL_INPUTS: dict[Any, Callable] = {}


def model_inputs(model) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
  """batch -> ``evaluation.model_inputs(model, batch)``, what the model reads of a training
  batch (REPAIR inside a method's objective, ``matching.REPAIR``), traceable; one function
  object per model config, as ``mean_loss``."""
  if model.config not in _MODEL_INPUTS:
    _MODEL_INPUTS[model.config] = functools.partial(evaluation.model_inputs, model)
  return _MODEL_INPUTS[model.config]


class PathEvaluator:
  """Loss and accuracy along interpolation paths on a fixed evaluation set.

  Args:
    model: the ``models.Model`` both endpoints belong to.
    batches: the evaluation batches (with "valid").
    chunk_size: lambdas evaluated per compiled call.
    bits_per_byte: report the loss in bits (a byte-level language model).
    circuit: evaluate the circuit path between the endpoints (``compiled_circuits``) instead
      of the straight line.
  """

  def __init__(self, model, batches: list[Mapping[str, np.ndarray]], *, chunk_size: int,
               bits_per_byte: bool, circuit: bool = False):
    self.model = model
    self.batches = batches
    self.chunk_size = chunk_size
    self.bits_per_byte = bits_per_byte
    self._evaluator = compiled_circuits(model) if circuit else compiled(model)[0]
    self._mesh = inputs.create_mesh()
    self._put = lambda b: inputs.shard_batch(b, self._mesh, whole=True)
    self._circuits: PathEvaluator | None = self if circuit else None

  def circuits(self) -> PathEvaluator:
    """The same evaluation of the circuit path (``circuit=True``), made on first use."""
    if self._circuits is None:
      self._circuits = PathEvaluator(self.model, self.batches, chunk_size=self.chunk_size,
                                     bits_per_byte=self.bits_per_byte, circuit=True)
    return self._circuits

  def __call__(self, params_a: Params, params_b: Params, lams: np.ndarray,
               batches: Iterable[Mapping[str, np.ndarray]] | None = None) -> dict[str, list[float]]:
    """{"loss": [len(lams)], "accuracy": [len(lams)]} on ``batches`` (default: the fixed set):
    global batches, which every process holds whole; the endpoints are replicated on the
    mesh here (``inputs.replicate``) once for all batches."""
    params_a, params_b = inputs.replicate((params_a, params_b), self._mesh)
    sums = lmc.evaluate_path(self._evaluator, params_a, params_b,
                             self.batches if batches is None else batches, lams,
                             chunk_size=self.chunk_size, put=self._put)
    loss = sums["loss"] / sums["count"]
    if self.bits_per_byte:
      loss = loss / np.log(2.0)
    return {"loss": loss.tolist(), "accuracy": (sums["correct"] / sums["count"]).tolist()}


def curve_result(curve: Mapping[str, list[float]], lams: np.ndarray) -> dict[str, Any]:
  """``curve`` with its loss and accuracy barriers (``lmc.barrier``)."""
  return dict(curve, loss_barrier=lmc.barrier(lams, curve["loss"]),
              accuracy_barrier=lmc.barrier(lams, curve["accuracy"], higher_is_better=True))


def evaluation_examples(config: ml_collections.ConfigDict, dataset: str
                        ) -> list[dict[str, np.ndarray]]:
  """The study's evaluation set: the batches of ``dataset``'s ``config.study.eval_split``
  that hold its first ``config.study.eval_examples`` examples (``inputs.first_examples``),
  whole in every process (``inputs.eval_batches``), so that every process hashes, adds noise
  to and evaluates the same examples as one process does.

  Raises:
    ValueError: naming ``config.study.eval_split``: ``dataset`` has no such split or slice.
  """
  inputs.split_range(config, "study.eval_split", dataset)  # the error names the field
  return list(inputs.eval_batches(config, dataset, config.study.eval_split,
                                  limit=config.study.eval_examples, whole=True))


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
