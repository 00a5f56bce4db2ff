r"""The streamed ``attn-symmetry align`` on a planted Mistral-7B-shaped bfloat16 pair.

    python benchmarks/bench_streamed_alignment.py [--layers=32] [--method=perm] [--max-rounds=N]
                                                  [--memory-budget=GB] [--workdir=DIR]

Writes A (random, Mistral-7B's shapes: width 4096, FFN 14336, 32 heads in 8 kv groups of head
dim 128, vocabulary 32000, ``--layers`` layers; norm gains one) and B = g . A (heads permuted
within kv groups, FFN units permuted) with the test helpers of
``tests/test_streamed_alignment.py``, then runs ``attn-symmetry align A B --out DIR --method
METHOD`` in a child and prints its wall time, its stages' times (from its report) and its peak
RSS (``os.wait4``) against both checkpoints' size. The helpers write (and plant) tensor by
tensor; the alignment holds one layer of each at a time.
``--memory-budget`` (default 6 GB) is passed on: below the four float32 models that the
function check holds (7 GB at one layer), so that every depth streams end to end.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tests import test_streamed_alignment as helpers  # pylint: disable=g-import-not-at-top

GIB = 2 ** 30


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--layers", type=int, default=32)
  parser.add_argument("--method", default="perm")
  parser.add_argument("--max-rounds", type=int, default=None,
                      help="most rounds of the descent (default: until it converges)")
  parser.add_argument("--memory-budget", default="6",
                      help="the command's --memory-budget in GB (default 6: streams every depth)")
  parser.add_argument("--workdir", default=None)
  args = parser.parse_args()
  work = args.workdir or tempfile.mkdtemp(prefix="bench_streamed_")
  a, b, out = (os.path.join(work, x) for x in ("a", "b", "out"))
  start = time.perf_counter()
  helpers.write_mistral(a, args.layers, seed=0)
  helpers.plant(a, b, seed=1)
  size = sum(os.path.getsize(os.path.join(x, "model.safetensors")) for x in (a, b))
  print(f"wrote the pair ({args.layers} layers, {size / GIB:.2f} GiB) in "
        f"{time.perf_counter() - start:.0f} s", flush=True)
  start = time.perf_counter()
  rounds = [] if args.max_rounds is None else ["--max-rounds", str(args.max_rounds)]
  status, peak, err = helpers._align_in_child(a, b, "--out", out, "--method", args.method,  # pylint: disable=protected-access
                                              "--memory-budget", args.memory_budget, *rounds)
  wall = time.perf_counter() - start
  if status:
    raise SystemExit(err)
  with open(os.path.join(out, "report.json"), encoding="utf-8") as f:
    report = json.load(f)
  stages = ", ".join(f"{k} {v:.0f} s" for k, v in report["time_s"].items())
  print(f"{args.layers} layers, method {args.method}, {report['rounds']} rounds: "
        f"{wall:.0f} s ({stages}); peak RSS "
        f"{peak / GIB:.2f} GiB, checkpoints {size / GIB:.2f} GiB; relative distance "
        f"{report['distance']['before']['relative']:.3g} -> "
        f"{report['distance']['after']['relative']:.3g}")
  if args.workdir is None:
    shutil.rmtree(work)


if __name__ == "__main__":
  main()
