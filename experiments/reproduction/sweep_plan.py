"""How long each point of the accelerator sweep should take on one GPU, before it runs.

``experiments/accelerator_sweep.py`` prints this plan before it starts and records it
beside what each point took. Nothing here is measured: the figures of ``Assumptions``
are stated guesses for one H100 (or H200), for the byte-level GPT-2 of the
width sweep in float32 at the "highest" matmul precision, to be replaced by the
seconds that the first GPU run records (``run.json``: ``accelerator.predicted_s``
beside ``wall_seconds``). A point's prediction is

    startup_s + compile_s
      + sum over its runs of  steps x (host_s_per_step + 3 F / flops_per_s)
                              + validations x validation_s
      + pairs x study_s_per_pair

with F the matmul FLOPs of one forward pass of a training batch (``forward_flops``;
the backward pass is twice it) and every run taken to its step budget (the
stopping rule may end one sooner). Points that share the GPU (``jobs`` > 1) each
take ``sharing_slowdown`` times as long: their host work runs on cores of their
own, their kernels in turn.
"""

from __future__ import annotations

import dataclasses
import math

import ml_collections

from attn_symmetry import models
from experiments.train import runs as runs_lib

VOCAB_SIZE = 256  # byte-level text


@dataclasses.dataclass(frozen=True)
class Assumptions:
  """Stated throughput of one GPU (not measured; the module docstring).

  Attributes:
    startup_s: a point's process start: imports, the GPU's client, the data.
    compile_s: a point's compilation: training and evaluation steps, and the
      study's programs (on a CPU core a point's runlocal form compiles about 200
      programs in 20-90 s).
    host_s_per_step: the host's share of a training step: the input batch,
      its transfer, the dispatch of the jitted step (no larger than the kernels'
      launch overhead of a 2-layer model's step).
    flops_per_s: sustained float32 matmul FLOP/s of a training step at the
      "highest" precision (the H100's float32 peak is about 67 TFLOP/s; these
      matrices are small).
    validation_s: one validation of the stopping rule (a forward pass over the
      validation windows, its host sync, the checkpoint it may save).
    study_s_per_pair: one pair's study: the three methods (the full method's
      Adam refinement, the learned method's training and its held-out
      evaluations) and their interpolation paths.
    sharing_slowdown: how much longer each point takes when the points share
      the GPU.
  """
  startup_s: float = 20.0
  compile_s: float = 60.0
  host_s_per_step: float = 1.5e-3
  flops_per_s: float = 25e12
  validation_s: float = 0.2
  study_s_per_pair: float = 6.0
  sharing_slowdown: float = 1.3


@dataclasses.dataclass(frozen=True)
class PointPlan:
  """One point's predicted cost.

  Attributes:
    setting: the setting.
    seeds: its re-initialisation seeds.
    steps: training steps of all its runs, each to its budget.
    pairs: seed pairs the study compares (per scope, summed).
    gflop_per_step: matmul GFLOPs of one training step (forward and backward).
    predicted_s: its wall time alone on the GPU.
  """
  setting: str
  seeds: int
  steps: int
  pairs: int
  gflop_per_step: float
  predicted_s: float

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def forward_flops(config: ml_collections.ConfigDict) -> int:
  """Matmul FLOPs (2 per multiply-add) of one forward pass of a training batch of the
  language model of ``config``: B windows of T bytes through L layers of width D, H heads
  of dimension D / H, an FFN of F, a vocabulary of V:
  B T (L (8 D^2 + 4 D F + 4 T D) + 2 D V)."""
  cfg = models.make_config(config.model.family, config.model.preset,
                           **{**config.model.overrides, "vocab_size": VOCAB_SIZE,
                              "max_len": config.dataset.seq_len})
  tokens = config.dataset.seq_len
  d, f = cfg.width, cfg.mlp_dim
  per_token = cfg.depth * (8 * d * d + 4 * d * f + 4 * tokens * d) + 2 * d * cfg.vocab_size
  return config.train.batch_size * tokens * per_token


def predict(setting: str, config: ml_collections.ConfigDict,
            assumptions: Assumptions = Assumptions()) -> PointPlan:
  """``setting``'s cost on one GPU alone, every run to its step budget (module docstring)."""
  a = assumptions
  step_flops = 3 * forward_flops(config)
  step_s = a.host_s_per_step + step_flops / a.flops_per_s
  train_s = 0.0
  steps = 0
  for run in runs_lib.runs(config):
    n = runs_lib.schedule(config, run).num_steps
    rule = runs_lib.stopping(config, run)
    validations = n // rule.validate_every if rule else 0
    steps += n
    train_s += n * step_s + validations * a.validation_s
  seeds = len(config.reinit.seeds)
  pairs = len(config.reinit.scopes) * math.comb(seeds, 2)
  predicted = a.startup_s + a.compile_s + train_s + pairs * a.study_s_per_pair
  return PointPlan(setting, seeds, steps, pairs, step_flops / 1e9, round(predicted, 1))


def makespan(points: list[PointPlan], jobs: int,
             assumptions: Assumptions = Assumptions()) -> dict[str, float]:
  """When each point should end, run ``jobs`` at a time in the order given (each started
  as soon as a lane is free; slowed by ``sharing_slowdown`` when ``jobs`` > 1 and more than
  one point runs): {setting: predicted seconds from the start}."""
  slowdown = assumptions.sharing_slowdown if jobs > 1 and len(points) > 1 else 1.0
  lanes = [0.0] * max(1, min(jobs, len(points)))
  ends = {}
  for p in points:
    lane = min(range(len(lanes)), key=lanes.__getitem__)
    lanes[lane] += p.predicted_s * slowdown
    ends[p.setting] = round(lanes[lane], 1)
  return ends


def longest_first(points: list[PointPlan]) -> list[PointPlan]:
  """The points by predicted cost, longest first (so that lanes end together)."""
  return sorted(points, key=lambda p: -p.predicted_s)
