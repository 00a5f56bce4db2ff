"""Unit tests of the training pieces that need no model: metrics files, re-init masks, optimiser."""

import glob
import os
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.record_writer import masked_crc32c
from tensorboardX.proto import event_pb2

from experiments import main
from experiments.configs import default
from experiments.configs import quickstart
from experiments.train import loop as loop_lib
from experiments.train import metric_writers
from experiments.train import optimizer as optimizer_lib
from experiments.train import reinit
from experiments.train import runs as runs_lib
from experiments.train import schedules

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tensorboard_events(path):
  """The Event protos of a TFRecord file, each record's CRCs checked (tensorboardX's CRC-32C)."""
  data, i, out = open(path, "rb").read(), 0, []
  while i < len(data):
    header = data[i:i + 8]
    (length,) = struct.unpack("<Q", header)
    assert struct.unpack("<I", data[i + 8:i + 12])[0] == masked_crc32c(header)
    payload = data[i + 12:i + 12 + length]
    assert struct.unpack("<I", data[i + 12 + length:i + 16 + length])[0] == \
        masked_crc32c(payload)
    i += 16 + length
    out.append(event_pb2.Event.FromString(payload))
  return out


def _tensorboard_scalars(path):
  """{(step, tag): value} of the scalar summaries of an event file."""
  return {(e.step, v.tag): v.simple_value for e in _tensorboard_events(path)
          for v in e.summary.value}


def test_metric_writer_json_and_tensorboard(tmp_path):
  writer = metric_writers.MetricWriter(str(tmp_path))
  for step in (1, 2, 3):
    writer.write_scalars(step, {"train/loss": 1.0 / step, "eval/accuracy": 0.25 * step})
  writer.close()
  log = metric_writers.read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert [e["step"] for e in log] == [1, 2, 3]
  assert log[1]["train/loss"] == 0.5
  (events,) = glob.glob(str(tmp_path / "events.out.tfevents.*"))
  assert _tensorboard_events(events)[0].file_version == "brain.Event:2"
  scalars = _tensorboard_scalars(events)
  assert scalars[(3, "eval/accuracy")] == pytest.approx(0.75)
  assert scalars[(2, "train/loss")] == pytest.approx(0.5)
  assert len(scalars) == 6

  # Resuming from step 1 drops what was logged after it, so steps stay unique; a new event
  # file (the first one kept) tells TensorBoard to discard the earlier file's steps from 2 on.
  writer = metric_writers.MetricWriter(str(tmp_path), resume_step=1)
  writer.write_scalars(2, {"train/loss": 7.0})
  writer.close()
  log = metric_writers.read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert [(e["step"], e["train/loss"]) for e in log] == [(1, 1.0), (2, 7.0)]
  (resumed,) = set(glob.glob(str(tmp_path / "events.out.tfevents.*"))) - {events}
  assert _tensorboard_scalars(events)[(2, "train/loss")] == pytest.approx(0.5)  # kept
  purge = [e for e in _tensorboard_events(resumed) if e.HasField("session_log")]
  assert [(e.step, e.session_log.status) for e in purge] == [(2, event_pb2.SessionLog.START)]
  assert _tensorboard_scalars(resumed) == {(2, "train/loss"): 7.0}


_WRITER_WITHOUT_TORCH = """
import sys
from experiments.train import metric_writers
metric_writers.MetricWriter(sys.argv[1]).write_scalars(1, {"loss": 1.0})
assert "torch" not in sys.modules, "the writer imported torch"
import torch  # still importable afterwards
print(torch.ones(2).sum().item())
"""


def test_metric_writer_does_not_import_torch(tmp_path):
  """A fresh process's first writer leaves torch unimported (tensorboardX imports it where
  installed, 1.5 s of every training's start), and torch imports afterwards as usual."""
  pytest.importorskip("torch")  # in the [hf] extra, which CI installs
  proc = subprocess.run([sys.executable, "-c", _WRITER_WITHOUT_TORCH, str(tmp_path)], cwd=REPO,
                        env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.split() == ["2.0"]


def test_metric_writer_disabled_writes_nothing(tmp_path):
  writer = metric_writers.MetricWriter(str(tmp_path / "run"), enabled=False)
  writer.write_scalars(1, {"loss": 1.0})
  writer.close()
  assert not os.path.exists(tmp_path / "run")


def test_progress_line_eta(monkeypatch):
  clock = iter([0.0, 100.0, 200.0, 300.0])  # Construction, begin, two lines.
  monkeypatch.setattr(metric_writers.time, "perf_counter", lambda: next(clock))
  progress = metric_writers.Progress(total=20, width=10)
  progress.begin(5)
  line = progress.line(10, {"loss": 0.5})  # 5 steps in 100 s; 10 steps left.
  assert line == "[#####     ]  50% step 10/20, loss 0.5 | 20.00s/step | ETA 03:20"
  line = progress.line(20, {"loss": 0.25})  # 15 steps in 200 s; done.
  assert line == "[##########] 100% step 20/20, loss 0.25 | 13.33s/step | ETA 00:00"
  assert "\r" not in line  # one line per call, readable in a log file


def _toy_params():
  return {"embed": {"embedding": jnp.ones((5, 4))},
          "layers_0": {"attention": {"query": {"kernel": jnp.ones((4, 2, 2)),
                                               "bias": jnp.ones((2, 2))}},
                       "mlp": {"kernel": jnp.ones((4, 8))}},
          "layers_1": {"attention": {"query": {"kernel": jnp.ones((4, 2, 2))}}},
          "layers_10": {"attention": {"query": {"kernel": jnp.ones((4, 2, 2))}}}}


def test_trainable_mask_prefixes():
  params = _toy_params()
  flat = lambda mask: {p for p, m in reinit.spec_lib.flatten(mask).items() if m}
  assert flat(reinit.trainable_mask(params, ["layers_1/attention"])) == {
      "layers_1/attention/query/kernel"}  # Not layers_10.
  assert flat(reinit.trainable_mask(params, ["layers_0"])) == {
      "layers_0/attention/query/kernel", "layers_0/attention/query/bias", "layers_0/mlp/kernel"}
  assert len(flat(reinit.trainable_mask(params, [""]))) == 6
  with pytest.raises(ValueError, match="layers_3"):
    reinit.trainable_mask(params, ["layers_3/attention"])
  with pytest.raises(ValueError, match="at least one"):
    reinit.trainable_mask(params, [])


def test_reinitialise_and_changed_frozen_is_bitwise():
  trained = {"a": np.zeros(3, np.float32), "b": np.ones(3, np.float32)}
  fresh = {"a": np.full(3, 2.0, np.float32), "b": np.full(3, 5.0, np.float32)}
  mask = {"a": False, "b": True}
  params = reinit.reinitialise(trained, fresh, mask)
  assert params["a"] is trained["a"] and params["b"] is fresh["b"]
  assert reinit.changed_frozen(trained, params, mask) == []
  # -0.0 == 0.0 numerically but not bit for bit: it must count as a change.
  assert reinit.changed_frozen(trained, {"a": -np.zeros(3, np.float32), "b": fresh["b"]},
                               mask) == ["a"]


def test_optimizer_freezes_masked_leaves():
  config = default.get_config()
  params = {"frozen": {"kernel": jnp.ones((3, 3))},
            "train": {"kernel": jnp.ones((3, 3)), "bias": jnp.ones(3)}}
  trainable = {"frozen": {"kernel": False}, "train": {"kernel": True, "bias": True}}
  sched = schedules.Schedule(num_steps=10, learning_rate=0.1, warmup_steps=1)
  optimizer, lr = optimizer_lib.create_optimizer(config, sched, trainable)
  state = optimizer.init(params)
  # Adam moments exist for the trainable leaves only.
  moments = [x for x in jax.tree.leaves(state) if x.ndim == 2]
  assert len(moments) == 2
  grads = jax.tree.map(jnp.zeros_like, params)
  update = jax.jit(optimizer.update)
  _, state = update(grads, state, params)  # Step 0 of the warmup: learning rate 0.
  updates, _ = update(grads, state, params)
  assert lr(0) == 0 and lr(1) > 0
  np.testing.assert_array_equal(updates["frozen"]["kernel"], 0.0)
  # With zero gradients only weight decay moves a leaf: matrices, not biases.
  assert np.all(np.asarray(updates["train"]["kernel"]) < 0)
  np.testing.assert_array_equal(updates["train"]["bias"], 0.0)


@pytest.mark.parametrize("arg, error", [("rope,ape", "exclude"), ("bogus", "bogus")])
def test_config_variant_errors(arg, error):
  with pytest.raises(ValueError, match=error):
    quickstart.get_config(arg)


def test_default_workdir_names_setting_and_variant():
  assert main.default_workdir("experiments/configs/vit_cifar.py:rope,runlocal").endswith(
      os.path.join("attn_symmetry", "vit_cifar_rope_runlocal"))
  assert main.default_workdir("configs/quickstart.py").endswith(
      os.path.join("attn_symmetry", "quickstart"))


def test_runs_layout():
  config = default.get_config()
  config.reinit.scopes = ("first_attention", "full")
  config.reinit.seeds = (3, 4)
  config.reinit.dataset = "mnist5k"
  runs = runs_lib.runs(config)
  assert [r.name for r in runs] == ["base", "reinit/first_attention/seed_3",
                                    "reinit/first_attention/seed_4", "reinit/full/seed_3",
                                    "reinit/full/seed_4"]
  assert runs[0].dataset == "digits" and {r.dataset for r in runs[1:]} == {"mnist5k"}
  assert [r.fine_tunes for r in runs] == [False, True, True, False, False]
  assert runs_lib.run_dir("/w", runs[1]) == os.path.join("/w", "reinit", "first_attention",
                                                           "seed_3")
  assert runs_lib.schedule(config, runs[1]).num_steps == config.reinit.num_steps
  assert runs_lib.schedule(config, runs[3]).num_steps == config.train.num_steps


def _loop_schedule(step, num_steps, rule):
  """A training loop's schedule alone: only the fields that ``due`` and ``chunk_end`` read."""
  config = default.get_config()
  config.train.update(log_every=4, eval_every=6, checkpoint_every=10)
  plateau = None if rule is None else schedules.Plateau(rule)
  none = dict.fromkeys(("run", "model", "mesh", "state", "how", "batches", "train_step", "lr",
                        "ckpts", "writer"))
  return loop_lib.RunLoop(config=config, step=step, num_steps=num_steps, plateau=plateau, meta={},
                        **none)


@pytest.mark.parametrize("start", [0, 7, 22])
@pytest.mark.parametrize("rule", [None, schedules.Stopping(patience=2, min_delta=0.0,
                                                        validate_every=5)])
def test_chunks_end_exactly_where_something_falls_due(start, rule):
  """The loop leaves the device at every step where a log, an evaluation, a checkpoint, a
  validation (under the rule) or the budget's end falls due, and at no other: the same
  syncs, log means and decisions as checking every step."""
  num_steps = 23
  loop = _loop_schedule(start, num_steps, rule)
  ends = []
  while loop.step < num_steps:
    loop.step = loop.chunk_end()
    ends.append(loop.step)
  expected = {}
  for s in range(start + 1, num_steps + 1):
    last = s == num_steps
    due = {name for name, every in (("log", 4), ("evaluate", 6), ("save", 10),
                                    ("validate", rule and rule.validate_every)) if every
           and (s % every == 0 or last)}
    if due:
      expected[s] = due
  assert ends == sorted(expected)
  assert {s: loop.due(s) for s in ends} == expected
  assert ends[-1] == num_steps and loop.due(num_steps) == (
      {"log", "evaluate", "save"} | ({"validate"} if rule else set()))
