r"""``attn-symmetry align`` on two GPT-2-small-shaped random checkpoints on disk.

    python -m benchmarks.bench_align_checkpoints [--quick] [--layers=N] [--dtype=float32|bfloat16]
                                                 [--workdir=DIR]

Writes two random GPT-2 checkpoints (124M parameters at GPT-2 small's shape;
``--quick``: width 256, 4 layers; ``--layers``: another depth, e.g. 2 for a
quicker proxy at GPT-2 small's width) as Hugging Face folders, with numpy and
safetensors only, then runs ``python -m attn_symmetry.align A B --out DIR
--merge 0.5`` in a child process twice: with an empty compilation cache (a
first alignment of the architecture) and with the cache the first run filled.
Prints each run's stage times (its report's ``time_s``: check, align and apply, as the
command streams by default) and its peak RSS (the child's own VmHWM,
``tests/child_memory.py``) against the two checkpoints' size (goal: <= 3x); the
RSS of a child that only imports the command (JAX, Flax) is part of every peak.
"""

import argparse
import json
import os
import tempfile
import time

import numpy as np
from safetensors.numpy import save_file

from attn_symmetry.models import convert
from attn_symmetry.models import safetensors_io
from attn_symmetry.models.model import Model
from tests import child_memory

SIZES = {"full": dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024),
         "quick": dict(n_embd=256, n_layer=4, n_head=4, vocab_size=8192, n_positions=256)}
GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}


def write_checkpoint(folder: str, hf_config: dict, seed: int, dtype: str) -> None:
  """A random GPT-2 folder: weights N(0, 0.02), norm scales near one, small biases."""
  cfg = convert.config_from_hf(hf_config, "lm")
  model = Model(cfg)
  table, _ = convert.param_table(cfg)
  shapes = {src.key: convert.hf_shape(path, model.param_shapes[path], src)
            for path, src in table.items()}
  rng = np.random.default_rng(seed)
  stored = safetensors_io.DTYPES["BF16" if dtype == "bfloat16" else "F32"]
  tensors = {}
  for key, shape in shapes.items():
    if key.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
      x = 1 + 0.1 * rng.standard_normal(shape, np.float32)
    else:
      x = (0.02 if key.endswith("weight") else 0.01) * rng.standard_normal(shape, np.float32)
    tensors[key] = x.astype(stored)
  os.makedirs(folder)
  save_file(tensors, os.path.join(folder, safetensors_io.WEIGHTS), metadata={"format": "pt"})
  with open(os.path.join(folder, safetensors_io.CONFIG), "w", encoding="utf-8") as f:
    json.dump(hf_config, f, indent=2)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="width 256, 4 layers")
  parser.add_argument("--layers", type=int, help="number of layers (default: GPT-2 small's 12)")
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  parser.add_argument("--workdir", help="where the checkpoints go (default: a temporary folder)")
  parser.add_argument("--method", default="full")
  args = parser.parse_args()

  sizes = dict(SIZES["quick" if args.quick else "full"])
  if args.layers:
    sizes["n_layer"] = args.layers
  hf_config = {**GPT2, **sizes, "dtype": args.dtype}
  with tempfile.TemporaryDirectory(dir=args.workdir) as work:
    start = time.perf_counter()
    a, b, out = (os.path.join(work, name) for name in ("a", "b", "out"))
    write_checkpoint(a, hf_config, 0, args.dtype)
    write_checkpoint(b, hf_config, 1, args.dtype)
    size = sum(os.path.getsize(os.path.join(d, safetensors_io.WEIGHTS)) for d in (a, b))
    print(f"checkpoints: 2 x GPT-2 {sizes} in {args.dtype}, {size / 2**20:.0f} MiB together "
          f"(written in {time.perf_counter() - start:.1f} s)")
    base = child_memory.run("import attn_symmetry.align").peak
    print(f"importing the command alone: peak RSS {base / 2**20:.0f} MiB")
    command = "import sys; from attn_symmetry import align; sys.exit(align.main(sys.argv[1:]))"
    for run in ("empty compilation cache", "warm compilation cache"):
      child = child_memory.run(command, a, b, "--out", out, "--merge", "0.5", "--method",
                               args.method, "--overwrite", "--compilation-cache",
                               os.path.join(work, "jax_cache"))
      if child.status:
        raise SystemExit(f"attn-symmetry align failed:\n{child.stderr}")
      peak, wall, log = child.peak, child.seconds, child.stderr
      with open(os.path.join(out, "report.json"), encoding="utf-8") as f:
        report = json.load(f)
      stages = " | ".join(f"{name} {seconds:.1f} s" for name, seconds in report["time_s"].items())
      print(f"{run}:\n{log}")
      print(f"  {stages} ({report['rounds']} rounds; aligned_b and merged written) | whole "
            f"command {wall:.1f} s")
      print(f"  peak RSS {peak / 2**20:.0f} MiB = {peak / size:.2f} x the checkpoints (goal <= 3)")


if __name__ == "__main__":
  main()
