r"""What the test suite's XLA flags (``tests/conftest.py``, ``TEST_XLA_FLAGS``) buy and cost.

    python benchmarks/bench_test_compile.py [--repeats=2]

The suite's models are tiny, so its time goes to XLA:CPU compiling programs, not to running
them; the tests therefore start their backend with LLVM's optimisation off. This benchmark
measures both sides of that trade on the programs the tests compile most: a training step (the
gradient of a tiny Llama's loss) and weight matching of two tiny Llamas (``align_model``).
Each measurement runs in a fresh child process (XLA reads its flags once per process), with
and without the flags, alternating, so that both see the same load on a shared machine; it
prints each time and the ratios (flags / default): below one is faster with the flags.
"""

import argparse
import json
import subprocess
import sys
import os

# A fresh process: compiles the two programs (lower + compile, nothing cached), then runs each
# compiled program a few times; prints the seconds as JSON.
CHILD = r"""
import json, time
import jax, jax.numpy as jnp
from attn_symmetry import matching, models

jax.config.update("jax_enable_compilation_cache", False)
model = models.build("llama", "tiny")
a, b = model.init(jax.random.key(0)), model.init(jax.random.key(1))
tokens = jax.random.randint(jax.random.key(2), (8, 32), 0, model.config.vocab_size)

def loss(params):
  logits, _ = model.apply(params, tokens)
  return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
      logits, tokens[..., None], -1)[..., 0])

out = {}
start = time.perf_counter()
step = jax.jit(jax.grad(loss)).lower(a).compile()
out["compile_train_step"] = time.perf_counter() - start
start = time.perf_counter()
for _ in range(20):
  jax.block_until_ready(step(a))
out["run_train_step_x20"] = time.perf_counter() - start
start = time.perf_counter()
jax.block_until_ready(matching.align_model(model.spec, a, b))
out["first_align_model"] = time.perf_counter() - start  # compiling it, then one run
start = time.perf_counter()
jax.block_until_ready(matching.align_model(model.spec, a, b))
out["run_align_model"] = time.perf_counter() - start
print(json.dumps(out))
"""


def measure(flags: str) -> dict[str, float]:
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}".strip()
  done = subprocess.run([sys.executable, "-c", CHILD], env=env, check=True,
                        capture_output=True, text=True)
  return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=2)
  args = parser.parse_args()
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  sys.path.insert(0, root)
  from tests import conftest  # pylint: disable=import-outside-toplevel
  runs: dict[str, list[dict[str, float]]] = {"default": [], "test flags": []}
  for i in range(args.repeats):
    for name, flags in (("default", ""), ("test flags", conftest.TEST_XLA_FLAGS)):
      runs[name].append(measure(flags))
      print(f"repeat {i + 1} {name:10s} " + "  ".join(
          f"{k} {v:6.2f} s" for k, v in runs[name][-1].items()), flush=True)
  print(f"\nTEST_XLA_FLAGS = {conftest.TEST_XLA_FLAGS!r}; ratio flags / default "
        f"(median over {args.repeats} alternating repeats):")
  for key in runs["default"][0]:
    ratios = sorted(t[key] / d[key] for d, t in zip(runs["default"], runs["test flags"]))
    print(f"  {key:20s} {ratios[len(ratios) // 2]:.2f}")


if __name__ == "__main__":
  main()
