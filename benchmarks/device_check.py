r"""The device check: what one accelerator does with the library, in at most ten minutes.

    python -m benchmarks.device_check [--out=DIR] [--layers=2] [--lap-size=14336]
    python -m benchmarks.device_check --small     # every stage at toy sizes (any CPU, seconds)

Run it whenever an accelerator is at hand and quote its lines; nothing in CI needs it. Four
stages, each one line (and, with ``--out``, one entry of ``DIR/device_check.json``):

1. **matmul**: bfloat16 [M, M] x [M, M] products (M = ``--matmul-size``) back to back for about
   two seconds: the chip's measured matmul rate, beside its datasheet's dense bfloat16 peak
   where the device kind is one of ``DATASHEET_BF16_TFLOPS``.
2. **train step**: a GPT-2-shaped decoder (``--width``, ``--depth``, vocabulary 32000, batch of
   ``--batch`` x ``--seq-len`` tokens), AdamW on float32 parameters with the forward and backward
   passes in bfloat16 (``bench_train_step.make_step``); the best of three windows of
   ``--steps`` steps. Its matmul FLOPs (``bench_train_step.forward_matmul_flops``, 3 x the
   forward) per second, against stage 1's rate and the datasheet's.
3. **streamed alignment**: ``attn-symmetry align --method perm`` on a planted pair of random
   ``--layers``-layer Mistral-7B-shaped bfloat16 checkpoints (width 4096, FFN 14336, 32/8 heads,
   vocabulary 32000; B = g . A with heads and FFN units permuted), one round of the descent:
   its wall time and stages (``report.json``), the device's peak memory where the backend
   reports it, and whether B came back as A tensor for tensor.
4. **LAP**: the exact linear assignment (``matching._auction.solve``) of a random and a
   near-permutation float32 [n, n] cost on the device (n = ``--lap-size``, Mistral-7B's FFN
   width by default): its time after compilation and its certified gap (0 proves optimality).
   scipy's time on the host for the same random cost with ``--scipy`` (47 s at 14336 on one
   core of the CPU machine).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from attn_symmetry import align
from attn_symmetry import models
from attn_symmetry.matching import _auction
from benchmarks import bench_assignment
from benchmarks import bench_train_step
from tests import test_streamed_alignment as helpers

# Dense bfloat16 matmul peaks of the vendors' datasheets, TFLOP/s, by a part of the device kind
# that JAX reports (the first that matches). H100 and H200 are the SXM parts.
DATASHEET_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L4": 121.0,
                         "TPU v4": 275.0, "TPU v5 lite": 197.0, "TPU v5p": 459.0,
                         "TPU v6": 918.0}

SMALL_MISTRAL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=128)


def datasheet_peak(kind: str) -> float | None:
  """The datasheet's dense bfloat16 FLOP/s of a device kind, or None if not in the table."""
  for part, tflops in DATASHEET_BF16_TFLOPS.items():
    if part in kind:
      return tflops * 1e12
  return None


def matmul_rate(size: int, seconds: float = 2.0) -> dict:
  """Stage 1: the measured bfloat16 matmul FLOP/s (``bench_train_step.MatmulRate``)."""
  rate = bench_train_step.MatmulRate(size, jnp.bfloat16).measure(seconds)
  return {"size": size, "flops_per_s": rate}


def train_step(args) -> dict:
  """Stage 2: the mixed-precision training step's matmul FLOP/s."""
  model = models.build("gpt2", "small", width=args.width, depth=args.depth,
                       num_heads=args.width // 64, mlp_dim=4 * args.width,
                       vocab_size=args.vocab, max_len=args.seq_len)
  optimizer = optax.adamw(1e-4, weight_decay=0.01)
  params = model.init(jax.random.key(0))
  opt_state = optimizer.init(params)
  step = bench_train_step.make_step(model, optimizer, compute_dtype=jnp.bfloat16)
  seq = jax.random.randint(jax.random.key(2), (args.batch, args.seq_len + 1), 0, args.vocab)
  inputs, targets = seq[:, :-1], seq[:, 1:]
  start = time.perf_counter()
  params, opt_state, loss = step(params, opt_state, inputs, targets)
  loss.block_until_ready()
  compile_s = time.perf_counter() - start
  windows = []
  for _ in range(3):
    start = time.perf_counter()
    for _ in range(args.steps):
      params, opt_state, loss = step(params, opt_state, inputs, targets)
    loss.block_until_ready()
    windows.append((time.perf_counter() - start) / args.steps)
  flops = 3 * bench_train_step.forward_matmul_flops(model.config, args.batch, args.seq_len)
  count = sum(x.size for x in jax.tree.leaves(params))
  return {"params": count, "tokens": args.batch * args.seq_len, "step_s": min(windows),
          "first_step_s": compile_s, "flops": flops, "flops_per_s": flops / min(windows),
          "loss": float(loss)}


def streamed_alignment(args, work: str) -> dict:
  """Stage 3: the streamed command on a planted Mistral-shaped pair."""
  a, b, out = (os.path.join(work, x) for x in ("a", "b", "out"))
  sizes = SMALL_MISTRAL if args.small else {}
  helpers.write_mistral(a, args.layers, seed=0, **sizes)
  helpers.plant(a, b, seed=1)
  size = sum(os.path.getsize(os.path.join(x, "model.safetensors")) for x in (a, b))
  device = jax.devices()[0]
  start = time.perf_counter()
  status = align.cli(["align", a, b, "--out", out, "--method", "perm", "--max-rounds", "1",
                      "--quiet"])
  wall = time.perf_counter() - start
  if status:
    raise SystemExit(f"attn-symmetry align exited with {status}")
  with open(os.path.join(out, "report.json"), encoding="utf-8") as f:
    report = json.load(f)
  stats = device.memory_stats() or {}
  return {"layers": args.layers, "width": (SMALL_MISTRAL if args.small else helpers.MISTRAL)[
              "hidden_size"], "checkpoints_bytes": size, "wall_s": wall,
          "stages_s": report["time_s"], "devices": report["devices"],
          "peak_device_bytes": stats.get("peak_bytes_in_use"),
          "planted_recovered": not helpers.differing_tensors(a, os.path.join(out, "aligned_b"))}


def assignment(args) -> dict:
  """Stage 4: the exact assignment on the device, and (``--scipy``) scipy's on the host."""
  solve = jax.jit(_auction.solve)
  out = {"n": args.lap_size}
  for kind, cost in bench_assignment.costs(args.lap_size).items():
    device_cost = jnp.asarray(cost)
    _, first = bench_assignment.timed(lambda: solve(device_cost))  # compiles
    solution, seconds = bench_assignment.timed(lambda: solve(device_cost))
    out[kind] = {"seconds": seconds, "first_call_s": first, "gap": float(solution.gap),
                 "repaired_rows": int(solution.repaired)}
    if kind == "random" and args.scipy:
      import scipy.optimize  # pylint: disable=g-import-not-at-top
      (_, cols), out[kind]["scipy_seconds"] = bench_assignment.timed(
          lambda: scipy.optimize.linear_sum_assignment(cost))
      exact, rows = cost.astype(np.float64), np.arange(args.lap_size)
      optimum = exact[rows, cols].sum()
      ours = exact[rows, np.asarray(solution.perm)].sum()
      out[kind]["cost_minus_scipy_relative"] = float((ours - optimum) / abs(optimum))
  return out


def _rate(x: float | None) -> str:
  """FLOP/s in TFLOP/s, or GFLOP/s below one TFLOP/s ("-" for None)."""
  if x is None:
    return "-"
  return f"{x / 1e12:.1f} TFLOP/s" if x >= 1e12 else f"{x / 1e9:.1f} GFLOP/s"


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--out", default=None, help="folder for device_check.json")
  parser.add_argument("--small", action="store_true", help="toy sizes: checks that it runs")
  parser.add_argument("--matmul-size", type=int, default=8192)
  parser.add_argument("--width", type=int, default=1024)
  parser.add_argument("--depth", type=int, default=8)
  parser.add_argument("--vocab", type=int, default=32000)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq-len", type=int, default=1024)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--lap-size", type=int, default=14336)
  parser.add_argument("--scipy", action="store_true", help="also time scipy on the host")
  args = parser.parse_args(argv)
  if args.small:
    args.matmul_size, args.width, args.depth, args.vocab = 256, 64, 2, 256
    args.batch, args.seq_len, args.steps, args.layers, args.lap_size = 4, 64, 2, 1, 256
  device = jax.devices()[0]
  peak = datasheet_peak(device.device_kind)
  print(f"device: {device.device_kind} ({device.platform}), {jax.device_count()} device(s); "
        f"datasheet bf16 peak: {_rate(peak)}", flush=True)
  result = {"device_kind": device.device_kind, "platform": device.platform,
            "device_count": jax.device_count(), "datasheet_bf16_flops_per_s": peak}

  m = result["matmul"] = matmul_rate(args.matmul_size)
  share = f" ({m['flops_per_s'] / peak:.0%} of the datasheet)" if peak else ""
  print(f"matmul: bf16 {m['size']}^2: {_rate(m['flops_per_s'])}{share}", flush=True)

  t = result["train_step"] = train_step(args)
  shares = f"{t['flops_per_s'] / m['flops_per_s']:.0%} of the measured matmul rate"
  shares += f", {t['flops_per_s'] / peak:.0%} of the datasheet" if peak else ""
  print(f"train step: {t['params'] / 1e6:.1f}M parameters, {t['tokens']} tokens, "
        f"{t['step_s'] * 1e3:.1f} ms ({t['tokens'] / t['step_s']:,.0f} tokens/s; first step "
        f"{t['first_step_s']:.1f} s): {_rate(t['flops_per_s'])} of matmuls, {shares}",
        flush=True)

  work = tempfile.mkdtemp(prefix="device_check_")
  try:
    s = result["streamed_alignment"] = streamed_alignment(args, work)
  finally:
    shutil.rmtree(work)
  stages = ", ".join(f"{k} {v:.1f} s" for k, v in s["stages_s"].items())
  memory = ("-" if s["peak_device_bytes"] is None else
            f"{s['peak_device_bytes'] / 2 ** 30:.2f} GiB")
  print(f"streamed alignment: {s['layers']} Mistral-shaped layer(s) of width {s['width']}, "
        f"{s['checkpoints_bytes'] / 2 ** 30:.2f} GiB of checkpoints: {s['wall_s']:.1f} s "
        f"({stages}); peak device memory {memory}; planted pair recovered: "
        f"{s['planted_recovered']}", flush=True)

  a = result["assignment"] = assignment(args)
  for kind in ("random", "near-permutation"):
    r = a[kind]
    scipy_part = (f"; scipy on the host {r['scipy_seconds']:.1f} s, cost - scipy's "
                  f"{r['cost_minus_scipy_relative']:.1e} relative" if "scipy_seconds" in r else "")
    print(f"LAP n={a['n']} {kind}: {r['seconds']:.2f} s on the device (first call "
          f"{r['first_call_s']:.1f} s), certified gap {r['gap']:.1e}, repaired "
          f"{r['repaired_rows']} rows{scipy_part}", flush=True)

  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "device_check.json"), "w", encoding="utf-8") as f:
      json.dump(result, f, indent=1)
  return result


if __name__ == "__main__":
  main()
