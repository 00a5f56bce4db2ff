r"""The streamed ``attn-symmetry align`` on a planted Mistral-7B-shaped bfloat16 pair.

    python -m benchmarks.bench_streamed_alignment [--layers=32] [--method=perm] [--max-rounds=N]
                                                  [--memory-budget=GB] [--workdir=DIR]
                                                  [--match-batches=N] [--batch-size=N]
                                                  [--seq-len=N]

Writes A (random, Mistral-7B's shapes: width 4096, FFN 14336, 32 heads in 8 kv groups of head
dim 128, vocabulary 32000, ``--layers`` layers; norm gains one) and B = g . A (heads permuted
within kv groups, FFN units permuted) with the test helpers of
``tests/test_streamed_alignment.py``, then runs ``attn-symmetry align A B --out DIR --method
METHOD`` in a child and prints its wall time, its stages' times (from its report) and its own
peak RSS (``tests/child_memory.py``: not the writer's) against both checkpoints' size, and the
RSS sampled every second up to each progress line, one per stage and per pass over the layers
(``align_with_timeline``; all samples in DIR/rss.tsv). A pair that an earlier run of the same
depth left in ``--workdir`` is reused (writing it takes 4 minutes at 32 layers). The helpers
write (and plant) tensor by tensor; the alignment holds one layer of each at a time.
``--memory-budget`` (default 6 GB) is passed on: below the four float32 models that the
in-memory function check holds (7 GB at one layer), so that every depth streams end to end and
the function check reads the written folders back a layer at a time.

``--method activation`` runs the models on match data: a word-level tokenizer.json
(``tests/test_align_checkpoints.py``'s) of ``MATCH_WORDS`` written to A's folder, and DIR/match.txt,
random words from it, enough for ``--match-batches`` batches of ``--batch-size`` rows of
``--seq-len`` tokens (passed on; the command's defaults where not given). Measured peaks of both
methods: docs/align.md (where it says what streams).

    python -m benchmarks.bench_streamed_alignment --check-only --workdir=DIR

runs only that read-back function check (``align._function_check.streamed_function_check``) on
the pair and the outputs that an earlier run left in DIR, in a child: its time and peak RSS.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from tests import child_memory
from tests import test_align_checkpoints
from tests import test_streamed_alignment as helpers

GIB = 2 ** 30
MATCH_WORDS = [f"w{i}" for i in range(1000)]  # the match data's vocabulary (ids 1..1000)
DATA_FLAGS = {"match_batches": 8, "batch_size": 8, "seq_len": 128}  # the command's defaults


def align_with_timeline(work: str, *args: str) -> child_memory.Child:
  """``attn-symmetry align ARGS`` in a child (``child_memory.run``: its own peak RSS), its RSS
  sampled every second: written to WORK/rss.tsv (seconds, GiB) and summarised as the largest
  sample before each progress line (one per stage and per pass over the layers), so that a
  peak is placed in its pass."""
  align = helpers._ALIGN  # pylint: disable=protected-access
  child = child_memory.run(align, *args, sample_every=1.0)
  with open(os.path.join(work, "rss.tsv"), "w", encoding="utf-8") as f:
    f.writelines(f"{t:.1f}\t{rss / GIB:.3f}\n" for t, rss in child.samples)
  begin = 0.0
  for at, line in child.lines:
    if line.startswith("[align]"):
      inside = [rss for t, rss in child.samples if begin <= t <= at]
      print(f"  {at:7.0f} s  {line}  (RSS sampled up to {max(inside, default=0) / GIB:.2f} GiB)",
            flush=True)
      begin = at
  return child


def write_match_data(a: str, work: str, match_batches: int, batch_size: int,
                     seq_len: int) -> str:
  """Writes A's tokenizer.json (``MATCH_WORDS``, where A has none) and WORK/match.txt: random
  words of it, lines of 64, enough for ``match_batches`` batches of ``batch_size`` rows of
  ``seq_len`` tokens; returns the text file's path."""
  if not os.path.exists(os.path.join(a, "tokenizer.json")):
    test_align_checkpoints._tokenizer(a, MATCH_WORDS)  # pylint: disable=protected-access
  words = np.random.default_rng(0).choice(MATCH_WORDS, match_batches * batch_size * seq_len)
  path = os.path.join(work, "match.txt")
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(" ".join(words[i:i + 64]) + "\n" for i in range(0, len(words), 64))
  return path


def check_written(a: str, b: str, out: str) -> None:
  """The read-back function check of ``out``/aligned_b against ``b`` (and aligned_a against
  ``a`` where it was written), as ``attn-symmetry align`` runs it: prints its result and
  seconds as one JSON line on stderr."""
  from attn_symmetry.align import _function_check, _records
  from attn_symmetry.models import Model, safetensors_io
  sources = {"aligned_a": safetensors_io.Checkpoint(a), "aligned_b": safetensors_io.Checkpoint(b)}
  model = Model(sources["aligned_a"].config)
  written = {name: (source, safetensors_io.Checkpoint(os.path.join(out, name)))
             for name, source in sources.items() if os.path.isdir(os.path.join(out, name))}
  options = _records.Options(method="perm", out=out)
  start = time.perf_counter()
  result = _function_check.streamed_function_check(model, options,
                                                   _function_check.check_inputs(model), written)
  print(json.dumps(result | {"seconds": time.perf_counter() - start}), file=sys.stderr)


def _check_only(work: str) -> None:
  """``--check-only``: ``check_written`` on ``work``'s a, b and out in a child."""
  code = ("import sys; from benchmarks import bench_streamed_alignment; "  # the same folder
          "bench_streamed_alignment.check_written(*sys.argv[1:])")
  child = child_memory.run(code, *(os.path.join(work, x) for x in ("a", "b", "out")))
  if child.status:
    raise SystemExit(child.stderr)
  peak, wall = child.peak, child.seconds
  result = json.loads(child.stderr.strip().splitlines()[-1])
  size = sum(os.path.getsize(os.path.join(work, x, "model.safetensors")) for x in ("a", "b"))
  folders = ", ".join(f"{k} {v['relative']:.2g} of its source's logits"
                      for k, v in result.items() if k.startswith("aligned_"))
  print(f"read-back function check: {result['seconds']:.0f} s ({wall:.0f} s with the child's "
        f"start); peak RSS {peak / GIB:.2f} GiB, checkpoints {size / GIB:.2f} GiB; {folders}")


def _check_reused(work: str, layers: int) -> None:
  """Refuses a pair left in ``work`` by an earlier run of another depth, or an output folder."""
  with open(os.path.join(work, "a", "config.json"), encoding="utf-8") as f:
    depth = json.load(f)["num_hidden_layers"]
  if depth != layers:
    raise SystemExit(f"{work} holds a pair of {depth} layers from an earlier run, not --layers="
                     f"{layers}: give another --workdir")
  if os.path.exists(os.path.join(work, "out")):
    raise SystemExit(f"{work}/out holds an earlier run's outputs: move it away to run again on "
                     "its pair")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--layers", type=int, default=32)
  parser.add_argument("--method", default="perm")
  parser.add_argument("--max-rounds", type=int, default=None,
                      help="most rounds of the descent (default: until it converges)")
  parser.add_argument("--memory-budget", default="6",
                      help="the command's --memory-budget in GB (default 6: streams every depth)")
  for flag, default in DATA_FLAGS.items():
    parser.add_argument("--" + flag.replace("_", "-"), type=int, default=default,
                        help=f"--method activation: the command's flag (default {default})")
  parser.add_argument("--workdir", default=None,
                      help="where the pair and the outputs go (default: a temporary folder, "
                           "removed after); a pair an earlier run left there is reused")
  parser.add_argument("--check-only", action="store_true",
                      help="only the read-back function check on an earlier run's --workdir")
  args = parser.parse_args()
  if args.check_only:
    if args.workdir is None:
      parser.error("--check-only reads an earlier run's outputs: give its --workdir")
    _check_only(args.workdir)
    return
  work = args.workdir or tempfile.mkdtemp(prefix="bench_streamed_")
  a, b, out = (os.path.join(work, x) for x in ("a", "b", "out"))
  start = time.perf_counter()
  if os.path.isdir(a) and os.path.isdir(b):
    _check_reused(work, args.layers)
    what = f"reused the pair in {work}"
  else:
    helpers.write_mistral(a, args.layers, seed=0)
    helpers.plant(a, b, seed=1)
    what = "wrote the pair"
  size = sum(os.path.getsize(os.path.join(x, "model.safetensors")) for x in (a, b))
  print(f"{what} ({args.layers} layers, {size / GIB:.2f} GiB) in "
        f"{time.perf_counter() - start:.0f} s", flush=True)
  extra = [] if args.max_rounds is None else ["--max-rounds", str(args.max_rounds)]
  if args.method == "activation":
    sizes = {flag: getattr(args, flag) for flag in DATA_FLAGS}
    extra += ["--match-data", write_match_data(a, work, **sizes)]
    extra += [x for flag, n in sizes.items() for x in ("--" + flag.replace("_", "-"), str(n))]
  child = align_with_timeline(work, a, b, "--out", out, "--method", args.method,
                              "--memory-budget", args.memory_budget, *extra)
  if child.status:
    raise SystemExit(child.stderr)
  peak, wall = child.peak, child.seconds
  with open(os.path.join(out, "report.json"), encoding="utf-8") as f:
    report = json.load(f)
  stages = ", ".join(f"{k} {v:.0f} s" for k, v in report["time_s"].items())
  data = (f" on {args.match_batches} match batches of {args.batch_size} x {args.seq_len} tokens"
          if args.method == "activation" else f", {report['rounds']} rounds")
  print(f"{args.layers} layers, method {args.method}{data}: "
        f"{wall:.0f} s ({stages}); peak RSS "
        f"{peak / GIB:.2f} GiB, checkpoints {size / GIB:.2f} GiB; relative distance "
        f"{report['distance']['before']['relative']:.3g} -> "
        f"{report['distance']['after']['relative']:.3g}")
  if args.workdir is None:
    shutil.rmtree(work)


if __name__ == "__main__":
  main()
