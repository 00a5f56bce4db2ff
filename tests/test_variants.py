"""The study variants (cpu_paper.STUDY_VARIANTS: the learned method's, the O(d-1) residual's):
each trains exactly what its base setting trains, its workdir starts as a copy of the base's,
and the report sets its barriers against the base's on the same pairs."""

import itertools
import json
import os

import pytest

from experiments.configs import cpu_paper
from experiments.report import claims
from experiments.report import variants
from experiments.report import report
from experiments.report import seed_statistics as ss
from experiments.reproduction import runner
from experiments.setting import fingerprints
from tests.test_reproduce import _leaves  # a config's fields as (dotted path, value)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = sorted(cpu_paper.LEARN_VARIANTS)
# What trains the runs: a variant whose fields here equal its base's has the base's endpoints.
TRAINED_BY = (fingerprints.TRAINING + fingerprints.TRAIN_SCHEDULE + fingerprints.REINIT_SCHEDULE
              + fingerprints.STOPPING + fingerprints.PER_RUN)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("form", ["", ",reduced"])
def test_a_variant_is_its_base_with_only_the_learned_study_fields_changed(variant, form):
  base, study = cpu_paper.LEARN_VARIANTS[variant]
  configs = [cpu_paper.get_config(name + form) for name in (variant, base)]
  fields = [dict(_leaves(c.to_dict())) for c in configs]
  changed = {k for k in fields[0].keys() | fields[1].keys() if fields[0].get(k) != fields[1].get(k)}
  assert changed <= {".study.methods", ".study.repair", *(f".study.{k}" for k in study)}
  if form:  # the reduced form sets the budget of both (cpu_paper.reduced)
    study = {k: v for k, v in study.items() if k != "learn_steps"}
  assert {f".study.{k}" for k in study} <= changed
  v = configs[0].study
  assert (tuple(v.methods), v.repair) == (cpu_paper.LEARN_VARIANT_METHODS, False)
  assert {k: v[k] for k in study} == study
  assert (fingerprints.config_fields(configs[0], TRAINED_BY)
          == fingerprints.config_fields(configs[1], TRAINED_BY))
  # the changed field keys the learned stage apart from the base's: a copy of the base's
  # workdir recomputes the learned method and reuses naive
  keyed = [f"study.{k}" for k in study]
  assert (fingerprints.config_fields(configs[0], keyed)
          != fingerprints.config_fields(configs[1], keyed))


@pytest.mark.parametrize("variant", sorted({**cpu_paper.RESIDUAL_VARIANTS,
                                            **cpu_paper.REPAIR_VARIANTS}))
def test_a_full_model_variant_is_its_bases_full_scope_with_only_its_fields_changed(variant):
  base, study = cpu_paper.STUDY_VARIANTS[variant]
  if variant in cpu_paper.RESIDUAL_VARIANTS:
    assert study == {"match_residual": "orthogonal", "circuit_path": True}
  configs = [cpu_paper.get_config(name) for name in (variant, base)]
  fields = [dict(_leaves(c.to_dict())) for c in configs]
  changed = {k for k in fields[0].keys() | fields[1].keys() if fields[0].get(k) != fields[1].get(k)}
  assert {f".study.{k}" for k in study} <= changed <= {
      *(f".study.{k}" for k in study), ".reinit.scopes"}
  assert {k: configs[0].study[k] for k in study} == study
  assert tuple(configs[0].reinit.scopes) == ("full",) and "full" in configs[1].reinit.scopes
  assert tuple(configs[0].study.methods) == tuple(configs[1].study.methods)
  assert (fingerprints.config_fields(configs[0], TRAINED_BY)
          == fingerprints.config_fields(configs[1], TRAINED_BY))
  assert os.path.exists(os.path.join(REPO, "results", base, "full", "results.json")), base
  if variant in cpu_paper.RESIDUAL_VARIANTS:  # pre-LayerNorm streams: the O(d-1) factor
    assert configs[0].model.family in ("gpt2", "vit")
  else:  # REPAIR's rule without biases: a family without them, with REPAIR
    assert configs[0].model.family == "llama" and configs[0].study.repair
  assert variant not in cpu_paper.ACCELERATOR_ONLY


def test_each_base_is_a_committed_setting_with_the_learned_method():
  for base, _ in cpu_paper.LEARN_VARIANTS.values():
    config = cpu_paper.get_config(base)
    assert "learned" in config.study.methods
    assert os.path.exists(os.path.join(REPO, "results", base, "run.json")), base
  assert set(VARIANTS) <= set(cpu_paper.SETTINGS)
  assert not set(VARIANTS) & set(cpu_paper.ACCELERATOR_ONLY)


def test_a_variants_workdir_starts_as_a_copy_of_its_bases(tmp_path):
  variant = VARIANTS[0]
  base = cpu_paper.LEARN_VARIANTS[variant][0]
  root = str(tmp_path)
  assert runner.seed_workdir(root, variant, reduced=False) is None  # no base's workdir
  run = os.path.join(root, base, "reinit", "full", "seed_1")
  os.makedirs(run)
  with open(os.path.join(run, "fingerprint.json"), "w") as f:
    f.write("{}")
  os.makedirs(os.path.join(root, variant + ".copying", "stale"))  # an interrupted copy
  assert runner.seed_workdir(root, variant, reduced=False) == os.path.join(root, base)
  target = runner.workdir(root, variant, reduced=False)
  assert sorted(os.listdir(target)) == ["reinit"]
  assert os.path.exists(os.path.join(target, "reinit", "full", "seed_1", "fingerprint.json"))
  assert not os.path.exists(target + ".copying")
  assert runner.seed_workdir(root, variant, reduced=False) is None  # its own workdir is there
  assert runner.seed_workdir(root, base, reduced=False) is None  # no variant
  assert runner.seed_workdir(root, variant, reduced=True) is None  # the reduced base's is absent
  assert runner.workdir(root, variant, reduced=True) == os.path.join(root, variant + "_reduced")


def _commit(root, setting, barriers, seeds=5, circuit=None):
  """results/<setting> holding the "full" scope's pairs of seeds 1..``seeds``, each method's
  loss barrier ``barriers[method](a, b)`` (and its circuit path's, ``circuit[method](a, b)``)."""
  folder = os.path.join(root, setting)
  os.makedirs(os.path.join(folder, "full"))
  with open(os.path.join(folder, "run.json"), "w") as f:
    json.dump({"wall_seconds": 60}, f)
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump({"reinit": {"scopes": ["full"]}}, f)
  pairs = [{"a": f"seed_{a}", "b": f"seed_{b}", "methods": {
      m: {"loss_barrier": barrier(a, b), "accuracy_barrier": 0.0}
      for m, barrier in barriers.items()}}
           for a, b in itertools.combinations(range(1, seeds + 1), 2)]
  for p in pairs:
    for m, barrier in (circuit or {}).items():
      p["methods"][m]["circuit"] = {"loss_barrier": barrier(int(p["a"][5:]), int(p["b"][5:])),
                                    "accuracy_barrier": 0.0}
  with open(os.path.join(folder, "full", "results.json"), "w") as f:
    json.dump({"pairs": pairs}, f)
  return pairs


def test_the_report_pairs_each_variant_with_its_base_and_names_what_is_left_out(tmp_path):
  root = str(tmp_path)
  assert variants.table(root).startswith("No variant of the learned method is committed")
  variant, (base, _) = next(iter(cpu_paper.LEARN_VARIANTS.items()))
  naive = lambda a, b: 1.0 + 0.1 * a + 0.01 * b
  base_pairs = _commit(root, base, {"naive": naive, "full": lambda a, b: 0.5,
                                    "learned": lambda a, b: 0.2 + 0.01 * a})
  # the variant leaves 3 points of naive less than the base in every pair but seed 5's
  variant_pairs = _commit(root, variant, {
      "naive": naive, "learned": lambda a, b: (0.2 + 0.01 * a) - (0.03 if b < 5 else 0.0)
      * naive(a, b)})
  rows, left_out = variants.comparisons(root)
  assert [(r.variant, r.base, r.scope, r.method) for r in rows] == [
      (variant, base, "full", "learned")]  # the learned family compares the learned method
  (row,) = rows
  expected = ss.paired_difference(report.ratio_pairs(variant_pairs, "learned"),
                                  report.ratio_pairs(base_pairs, "learned"))
  assert row.difference == expected
  assert row.difference.mean == pytest.approx(-3.0 * 6 / 10)
  assert (row.difference.below, row.difference.above) == (6, 0)
  assert row.base_ratio == ss.jackknife(report.ratio_pairs(base_pairs, "learned"))
  assert row.naive_gap == 0.0
  assert row.change == variants.change_of(variant)
  assert left_out == [f"{v} (not committed)" for v in cpu_paper.LEARN_VARIANTS if v != variant]
  table = variants.table(root)
  (line,) = [t for t in table.splitlines() if t.startswith(f"| {variant} |")]
  assert (f"| {base} | full | learned | `{row.change}` | 10 |" in line
          and line.endswith("| 6 / 0 | n/a | 0 |"))
  assert "Not in the table: " in table
  # a variant whose base is not committed gives no row and says so
  other = next(v for v, (b, _) in cpu_paper.LEARN_VARIANTS.items() if b != base)
  _commit(root, other, {"naive": naive, "learned": naive})
  assert (f"{other} (its base {cpu_paper.LEARN_VARIANTS[other][0]} is not committed)"
          in variants.comparisons(root)[1])
  # the claims judge the base, not the variants that repeat its pairs
  settings = {r.setting for r in claims.verdict_rows(root)}
  assert base in settings and not settings & set(VARIANTS)


def test_the_residual_family_compares_every_method_both_runs_hold(tmp_path):
  root = str(tmp_path)
  assert variants.table(root, variants.RESIDUAL).startswith(
      "No variant of the O(d-1) residual is committed")
  variant, (base, _) = next(iter(cpu_paper.RESIDUAL_VARIANTS.items()))
  naive = lambda a, b: 2.0 + 0.1 * a
  _commit(root, base, {"naive": naive, "full": lambda a, b: 1.0, "activation": lambda a, b: 0.8,
                       "learned": lambda a, b: 0.6})
  # the variant has no activation matching: full and learned are compared, in its order;
  # its naive barrier differs by 1e-3 (endpoints trained again, not bit for bit)
  _commit(root, variant, {"naive": lambda a, b: naive(a, b) + 1e-3,
                          "learned": lambda a, b: 0.4, "full": lambda a, b: 0.5},
          circuit={"learned": lambda a, b: 0.1 * (naive(a, b) + 1e-3)})
  rows, _ = variants.comparisons(root, variants.RESIDUAL)
  assert [(r.variant, r.method) for r in rows] == [(variant, "learned"), (variant, "full")]
  assert all(r.difference.below == 10 for r in rows)
  assert rows[0].naive_gap == pytest.approx(1e-3)
  # the circuit path's barrier of learned is 10 % of the (ordinary) naive one in every pair
  assert rows[0].variant_circuit.estimate == pytest.approx(10.0)
  assert rows[1].variant_circuit is None
  assert rows[0].change == 'study.match_residual = "orthogonal", study.circuit_path = true'
  table = variants.table(root, variants.RESIDUAL)
  assert sum(t.startswith(f"| {variant} |") for t in table.splitlines()) == 2
  # a variant without any method but naive is left out, named
  other = list(cpu_paper.RESIDUAL_VARIANTS)[1]
  _commit(root, cpu_paper.RESIDUAL_VARIANTS[other][0], {"naive": naive, "full": naive})
  _commit(root, other, {"naive": naive})
  assert any(note.startswith(f"{other} (") for note in variants.comparisons(
      root, variants.RESIDUAL)[1])
  settings = {r.setting for r in claims.verdict_rows(root)}
  assert not settings & set(cpu_paper.RESIDUAL_VARIANTS)
