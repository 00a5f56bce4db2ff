"""Shared defaults that every setting in this folder overrides.

    python experiments/main.py --config=experiments/configs/default.py --workdir=/tmp/attn_symmetry/default

A setting file imports this module, takes ``get_config()``, changes the fields
that differ, and reads its variant argument with ``parse_arg``: a
comma-separated list such as "rope,runlocal" (``--config=FILE:rope,runlocal``).

Every field (its default, check, what it keys and what it does) is one entry of
``experiments/setting/config_schema.py``, from which ``get_config()`` is built; a setting
changes values of those fields and creates none. ``python -m
experiments.setting.config_schema`` lists them all.

List-valued fields are tuples, so that a flag sets them:
``--config.study.methods="('naive', 'full')"``. ``experiments/setting/config_checks.py``
checks every field before a run starts.
"""

from __future__ import annotations

import ml_collections

from attn_symmetry import models
from experiments.setting import config_schema


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The default setting: the quickstart's ViT on digits, without re-initialisation."""
  variants = parse_arg(arg, allowed=())
  config = config_schema.default_config()
  if "runlocal" in variants:
    runlocal(config)
  return config


def parse_arg(arg: str | None, allowed) -> set[str]:
  """The set of variant names in ``arg`` ("rope,runlocal").

  Raises:
    ValueError: naming any variant that is not in ``allowed`` (plus "runlocal").
  """
  names = {a.strip() for a in (arg or "").split(",") if a.strip()}
  unknown = names - set(allowed) - {"runlocal"}
  if unknown:
    raise ValueError(f"unknown config variant(s) {sorted(unknown)}; this setting accepts "
                     f"{sorted(set(allowed) | {'runlocal'})}")
  return names


def set_position_encoding(config: ml_collections.ConfigDict, variants: set[str], *,
                          ape: str, rope: str, default: str = "ape") -> None:
  """Sets ``model.overrides.pos_encoding`` from an "ape" or "rope" variant.

  Args:
    config: the setting's config, changed in place.
    variants: the parsed variant names.
    ape: the model's ``pos_encoding`` value for absolute encodings.
    rope: its value for rotary encodings.
    default: "ape" or "rope", used when neither variant is given.
  """
  if {"ape", "rope"} <= variants:
    raise ValueError("config variants 'ape' and 'rope' exclude each other")
  kind = "rope" if "rope" in variants else "ape" if "ape" in variants else default
  config.model.overrides.pos_encoding = rope if kind == "rope" else ape


def runlocal(config: ml_collections.ConfigDict) -> None:
  """Shrinks a setting in place so that its whole run takes seconds on a CPU."""
  config.model.preset = "tiny"
  for size in ("width", "depth", "mlp_dim"):
    if size in config.model.overrides:
      del config.model.overrides[size]
  if config.dataset.seq_len:
    config.dataset.seq_len = min(config.dataset.seq_len, 32)
  config.dataset.num_workers = 0
  train = config.train
  train.num_steps = 8
  train.batch_size = 8
  train.warmup_steps = 2
  train.log_every = 4
  train.eval_every = 8
  train.checkpoint_every = 4
  # Every run takes 8 steps, validating at 4 and 8 under the stopping rule, whose patience of 1
  # makes step 8 its earliest stop: a rule that cannot stop within a run's budget is refused
  # (config_checks), and one that could stop sooner would cut the runs that tests check whole.
  config.reinit.num_steps = 8
  config.reinit.warmup_steps = 1
  config.reinit.validate_every = 4
  if config.reinit.patience:
    config.reinit.patience = 1
  config.reinit.seeds = (1, 2)
  # The study evaluates every path on the first 64 examples of its split, in one batch of 64.
  # On the whole digits test split (2 batches of 256), path evaluations took 23 s of the 42 s of
  # tests/test_study.py's study, at the test run's compile options.
  config.train.eval_batch_size = 64
  config.study.eval_examples = min(config.study.eval_examples or 64, 64)
  config.study.num_lambdas = 5
  config.study.match_steps = 20
  config.study.learn_steps = 10
  config.study.learn_holdout_batches = 1
  config.study.distances = ("frobenius", "cosine")
  config.study.noise_levels = (0.0, 0.5)


def language_model(variants: set[str], *, family: str, dataset: str, seq_len: int = 256,
                   transfers: dict[str, str] | None = None, default_pe: str = "ape",
                   **model_overrides) -> ml_collections.ConfigDict:
  """A byte-level language-modelling setting (GPT-2 or Llama, 6 layers, 4 heads; BERT with
  ``head="mlm"``: masked language modelling on the same windows).

  Args:
    variants: parsed variants: "ape"/"rope", or a key of ``transfers``
      ("runlocal" is left to the caller, after its own changes).
    family: "gpt2", "llama" or "bert" (with ``head="mlm"``).
    dataset: the LM data set (A).
    seq_len: tokens per training window.
    transfers: variant name -> data set B of an A->B transfer.
    default_pe: "ape" or "rope" when the variants name neither.
    **model_overrides: further ``model.overrides``.
  """
  transfers = transfers or {}
  chosen = sorted(variants & set(transfers))
  if len(chosen) > 1:
    raise ValueError(f"config variants {chosen} exclude each other")
  config = get_config()
  config.model.family = family
  config.model.preset = "paper"
  config.model.overrides.update(model_overrides)
  set_position_encoding(config, variants, ape="learned", rope="rope", default=default_pe)
  config.dataset.name = dataset
  config.dataset.seq_len = seq_len
  _long_schedule(config, learning_rate=6e-4)
  if chosen:
    config.reinit.dataset = transfers[chosen[0]]
  return config


def wiki_bytes_setting(arg: str | None, *, family: str, **options) -> ml_collections.ConfigDict:
  """The offline byte-level setting on ``wiki_bytes`` (gpt2_wiki_bytes, llama_wiki_bytes,
  bert_mlm_wiki_bytes): ``language_model`` at ``cpu_schedule`` size on windows of 128 bytes;
  a re-initialised run stops after 5 validations (100 steps apart) without improvement, or
  after 3000 steps.

  Args:
    arg: the config variant string ("ape"/"rope", "runlocal").
    family: the model family.
    **options: further ``language_model`` arguments (``default_pe``, ``head``, ...).
  """
  variants = parse_arg(arg, allowed=("ape", "rope"))
  config = language_model(variants, family=family, dataset="wiki_bytes", seq_len=128, **options)
  cpu_schedule(config)
  config.reinit.num_steps = 3000
  stopping_rule(config, validation_split="validation", patience=5, validate_every=100)
  if "runlocal" in variants:
    runlocal(config)
  return config


def text_classifier(variants: set[str], *, dataset: str, seq_len: int
                    ) -> ml_collections.ConfigDict:
  """A BERT text-classification setting on bytes (6 layers, 4 heads).

  Args:
    variants: parsed variants: "ape"/"rope" ("runlocal" is left to the caller).
    dataset: the classification data set.
    seq_len: bytes per example (longer texts are cut).
  """
  config = get_config()
  config.model.family = "bert"
  config.model.preset = "paper"
  set_position_encoding(config, variants, ape="learned", rope="rope")
  config.dataset.name = dataset
  config.dataset.seq_len = seq_len
  _long_schedule(config, learning_rate=3e-4)
  return config


def cpu_schedule(config: ml_collections.ConfigDict) -> None:
  """Sizes an offline text setting for 2 CPU cores: a tiny model, minutes of training."""
  config.model.preset = "tiny"
  config.model.overrides.update(width=64, mlp_dim=256)
  t = config.train
  t.num_steps, t.batch_size, t.learning_rate, t.warmup_steps = 1000, 32, 2e-3, 100
  t.log_every, t.eval_every, t.checkpoint_every = 100, 500, 500
  r = config.reinit
  r.num_steps, r.learning_rate, r.warmup_steps = 500, 2e-3, 50


def stopping_rule(config: ml_collections.ConfigDict, *, validation_split: str,
                  patience: int, validate_every: int, min_delta: float = 1e-3,
                  train_split: str = "train") -> None:
  """Turns on the stopping rule of the re-initialised runs (``config.reinit.patience``), and
  the study's "learned" method, which picks its best iterate on the same held-out slice.

  Args:
    config: the setting's config, changed in place.
    validation_split: the held-out split the rule reads, e.g. "train[90%:]"
      with ``train_split`` "train[:90%]", or a real "validation" split.
    patience, validate_every, min_delta: the rule's ``config.reinit`` fields.
    train_split: what every run trains on; it shares no record with
      ``validation_split``.
  """
  config.dataset.train_split = train_split
  config.dataset.validation_split = validation_split
  r = config.reinit
  r.patience, r.validate_every, r.min_delta = patience, validate_every, min_delta
  if "learned" not in config.study.methods:
    config.study.methods = (*config.study.methods, "learned")


def _long_schedule(config: ml_collections.ConfigDict, *, learning_rate: float) -> None:
  """The schedule of the paper-scale text settings, every scope re-initialised."""
  config.train.num_steps = 20000
  config.train.batch_size = 64
  config.train.learning_rate = learning_rate
  config.train.warmup_steps = 1000
  config.train.log_every = 100
  config.train.eval_every = 2000
  config.train.checkpoint_every = 2000
  config.reinit.scopes = models.SCOPES
  config.reinit.num_steps = 5000
  config.reinit.learning_rate = learning_rate
  config.reinit.warmup_steps = 500
  # Every paper setting holds out the end of its training split: the re-initialised runs stop on
  # it and the study's "learned" method picks its iterate on it (the test split is only evaluated).
  stopping_rule(config, train_split="train[:99%]", validation_split="train[99%:]", patience=5,
                validate_every=500)
