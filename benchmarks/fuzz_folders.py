r"""The bad-folder property of ``tests/test_folder_fuzz.py``, run long.

    python -m benchmarks.fuzz_folders [--examples=2000] [--seed=0]     # from the checkout's root

Draws ``--examples`` cases per kind (safetensors headers, index files, torch.save zip
pickles) with hypothesis, from ``--seed``, reads each folder as the align command does, and
prints how many were read and how many refused with the one-line error. A case that raises
anything else, or changes a file outside its folder, stops the run with hypothesis's smallest
example of it (exit status 1).
"""

import argparse
import collections
import sys
import tempfile
import time

import hypothesis

from tests import test_folder_fuzz as fuzz


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--examples", type=int, default=2000, help="cases per kind")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  if args.examples < 1:
    parser.error(f"--examples must be at least 1, got {args.examples}")
  with tempfile.TemporaryDirectory() as root:
    base = fuzz.base_folder(root)
    tensors = fuzz.tensors_of(base)
    for kind, (strategy, write) in fuzz.STRATEGIES.items():
      counts, start = collections.Counter(), time.perf_counter()

      @hypothesis.seed(args.seed)
      @hypothesis.settings(max_examples=args.examples, deadline=None, database=None,
                           suppress_health_check=list(hypothesis.HealthCheck))
      @hypothesis.given(strategy(tensors))
      def check(case):
        counts[fuzz.run_case(root, base, write, case)] += 1

      check()
      print(f"{kind}: {sum(counts.values())} cases in {time.perf_counter() - start:.0f} s: "
            f"{counts['read']} read, {counts['refused']} refused in one line, none other",
            flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
