"""Every matching method is a ``Method`` that ``align_model`` calls one way: built-in or
registered, it declares the options and the arguments beyond them that it reads."""

import jax
import pytest

from attn_symmetry import matching
from attn_symmetry import models
from attn_symmetry import registry


def _pair():
  model = models.build("gpt2", "tiny")
  return model.spec, model.init(jax.random.key(0)), model.init(jax.random.key(1))


def test_every_method_is_a_registered_function():
  assert list(matching.METHODS)[:6] == ["naive", "perm", "ortho", "full", "learned",
                                        "activation"]
  for name, method in matching.METHODS.items():
    assert method.name == name and callable(method.align)
  assert matching.METHODS["activation"].inputs == (matching.ACTIVATIONS,)
  assert matching.METHODS["activation"].every_argument == ("activations", "match_batches")
  learned = matching.METHODS["learned"]
  assert "activations" not in learned.reads_arguments(matching.MatchOptions())
  assert "activations" in learned.reads_arguments(matching.MatchOptions(learn_init="activation"))


def test_a_registered_method_receives_the_arguments_it_declares_and_no_other_does():
  spec, a, b = _pair()
  seen = {}

  def align(spec, params_a, params_b, *, scope, **given):
    seen.update(given)
    return matching.METHODS["naive"].align(spec, params_a, params_b, scope=scope)

  with registry.scoped():
    matching.register_method("probe", align, options=("distance",), arguments=("anchors",))
    matching.align_model(spec, a, b, method="probe", anchors=[1])
    assert seen == {"distance": "frobenius", "anchors": [1]}
    with pytest.raises(ValueError, match="anchors are read by method 'probe' only, not by 'full'"):
      matching.align_model(spec, a, b, method="full", anchors=[1])
    with pytest.raises(ValueError, match=r"unknown options \['anchor'\] of method 'probe'"):
      matching.align_model(spec, a, b, method="probe", anchor=[1])
    with pytest.raises(ValueError, match=r"arguments \['steps'\] are matching options"):
      matching.register_method("probe2", align, arguments=("steps",))


def test_the_callers_name_no_built_in_method_that_needs_data():
  """The align command (``attn_symmetry/align/``) and the study (``experiments/study/``) reach
  every method through ``Method.needs`` and one provider each: neither names a method that
  needs data, in code or in prose."""
  import os  # pylint: disable=import-outside-toplevel
  import re  # pylint: disable=import-outside-toplevel
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  named = [name for name, m in matching.METHODS.items() if m.every_input]
  assert set(named) >= {"learned", "activation"}
  pattern = re.compile("|".join(f"[\"']{name}[\"']" for name in named))
  found = []
  for folder in ("attn_symmetry/align", "experiments/study"):
    for file in sorted(os.listdir(os.path.join(root, folder))):
      if file.endswith(".py"):
        text = open(os.path.join(root, folder, file), encoding="utf-8").read()
        found += [f"{folder}/{file}: {m.group()}" for m in pattern.finditer(text)]
  assert not found, found
