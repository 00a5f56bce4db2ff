"""Align and merge two Hugging Face checkpoints: ``attn-symmetry align`` and ``align_checkpoints``.

    attn-symmetry align MODEL_A MODEL_B --out DIR [--method full|ortho|perm|naive|learned]
                        [--scope ...]
                        [--merge 0.5] [--eval-text FILE | --eval-images DIR] [--dtype keep|float32]
                        [--function-tolerance TOL]

    from attn_symmetry import align_checkpoints
    result = align_checkpoints("seed1", "seed2", out="aligned", merge=0.5)
    result.element, result.params, result.report   # g, B' = g . theta_B, the report

MODEL_A and MODEL_B are local model folders of one architecture (GPT-2,
Llama, GPT-NeoX, BERT or ViT) in safetensors or PyTorch ``.bin`` files
(``models.safetensors_io``), read and written without torch.
B is aligned to A by ``matching.align_model`` on the zoo model's symmetry spec
(head permutations and per-head matrices of every attention layer, FFN and
residual-stream factors), and re-parametrised as g . B, which computes the
same function. ``align_checkpoints`` runs five stages, one function each, and
each announced by one progress line and timed in the report (``_clock.Clock``):

1. check (``_check.check``): the options alone (``check_options``: method, scope, merge,
   dtype, function tolerance, matching options, evaluation flags and sizes; no
   file is read), the packages the evaluation needs, then the folders
   (config, tensor names, shapes and dtypes), their
   architectures against each other, the output folder and the evaluation
   file. Every problem is refused here (or, for NaN weights, while loading)
   with a one-line ``InputError``, before anything is written;
2. load (``_in_memory.load``): both models' float32 parameters, one stored tensor at a time;
3. align (``_in_memory.align``): the element g and B' = g . B; squared distances ||A - B||,
   ||A - B'|| per top-level parameter group (``layers_i``, ``embed``, ...);
   then the function check (``_function_check``): the logits of B and B' (and
   of A and A', when A is re-parametrised) on CHECK_BATCH random inputs of the
   model's kind, drawn from ``jax.random.key(CHECK_SEED)``, B' and A' rounded
   to the dtypes they are written in. Above ``function_tolerance`` (relative to
   the largest logit; by default the square root of the written dtype's
   epsilon) it stops with a ``FunctionCheckError`` that gives the difference,
   and nothing is written;
4. evaluate (``_outputs.evaluate``; with an evaluation file, ``_eval_files``): loss and accuracy
   along (1 - lambda) A + lambda B ("before") and (1 - lambda) A' + lambda B'
   ("after"), and their barriers (``lmc``); with ``merge``, the merged
   model's loss and accuracy beside A's and B's (report "merged");
5. save (``_outputs.save``): DIR/aligned_b/ (B' as safetensors in B's tensor names, shards
   and dtypes, with B's config and every other file of B's folder: the tokenizer, a
   sentence-transformers model's ``modules.json`` and ``1_Pooling/``, ...,
   ``Checkpoint.side_files``), DIR/aligned_a/ when A is
   re-parametrised (A' likewise, in A's), DIR/merged/ with ``merge``
   ((1 - merge) A' + merge B' in A's layout), DIR/interpolation.json and .png
   with an evaluation file, DIR/report.json.

One gauge. RMSNorm models (Llama): an orthogonal map of the residual stream is
a symmetry only once the norm scales are folded into the weights that read them
(``group_action.fold_norm_scales``). When the alignment uses one, A is
re-parametrised too: A' is A folded (the same function, norm weights of one),
and it is A' and B' that lie close, tensor for tensor, and are compared and
merged; aligned_a/ holds A'. Otherwise A' is A itself, and aligned_b/ lies
close to MODEL_A. report.json's "compare" names the two folders: ["aligned_a",
"aligned_b"] or ["MODEL_A", "aligned_b"].

Streaming (``_streamed``). Every method but "learned", without an evaluation file, streams:
the check stage is followed by "align" (``matching.align_model_streamed``: the
descent reads both models one group of tensors at a time, a ``layers_i`` or the
embeddings or the final norm with the head, kept in their stored dtype and
computed in float32; a round is a pass over the layers plus the residual's
reduction) and "apply" (a last pass: each group of B' = g . B computed, rounded
and written tensor by tensor into the output folders, ``safetensors_io.FolderWriter``,
with the distances summed). Memory then holds a group of each model, not the
models, and does not grow with depth. ``Alignment.params`` and ``params_a`` need
A, B and their aligned copies whole in float32: they are kept only where four
float32 models fit the memory budget (``memory_budget``, ``--memory-budget``;
default the machine's memory), and the function check then runs on them.
Otherwise the folders written into the staging folder are read back beside
their sources a layer at a time (``Model.apply_streamed``) and checked so, before
anything is moved into DIR; without ``out`` the check is skipped and the
report's "function_check" says why. "learned" trains
on the interpolated model's loss and an evaluation runs whole models: both load
the models whole (the stages below), and are refused before any work where that
does not fit the budget; so is a streamed alignment whose largest group does not.

Memory and time (whole models: "learned" or an evaluation). Peak memory stays within 3x the
two checkpoints' size
(``benchmarks/bench_align_checkpoints.py``, GPT-2 small in float32): the
models are read one tensor at a time, B' is computed one top-level group of
leaves at a time with B's group released after it (B is kept only for an
evaluation: ``_records.Loaded``; the function check keeps only B's and A's logits on its
small batch, computed before they are released, and rounds B' and A' in place,
one leaf at a time), the merged model is computed leaf by leaf as it is
written, and the C heap's free pages are returned to the system after every
stage and between compiling the matching program and running it
(``runtime``). jaxlib's LAPACK kernels run on one OpenBLAS thread during the
call (``runtime.single_threaded_blas``): with OpenBLAS's own threads,
matching's batched inverses made GPT-2 small's alignment about 10x slower on
2 cores.

Outputs are written into a temporary folder inside DIR and then moved into
place; with ``overwrite`` the earlier outputs of this tool in DIR are replaced
and other files left alone. DIR may neither be nor contain nor lie inside
MODEL_A or MODEL_B, so nothing there is ever written.


The modules, in the order the stages run: ``_records`` (what the stages pass one another, the
errors, the returned ``Alignment``), ``_clock`` (progress lines and seconds), ``_check``,
``_in_memory`` (load and align whole models) or ``_streamed`` (align and apply a group at a
time), ``_function_check``, ``_distances``, ``_outputs`` (evaluate, report, save), ``_pipeline``
(``align_checkpoints``) and ``_cli`` (the command)."""

from attn_symmetry.align._cli import cli, main
from attn_symmetry.align._function_check import CHECK_BATCH, CHECK_SEED, CHECK_TOKENS
from attn_symmetry.align._pipeline import align_checkpoints
from attn_symmetry.align._records import (DTYPES, MATCHING_OPTIONS, OUTPUTS, Alignment,
                                          AlignWarning, FunctionCheckError, InputError)

__all__ = ["CHECK_BATCH", "CHECK_SEED", "CHECK_TOKENS", "DTYPES", "MATCHING_OPTIONS", "OUTPUTS",
           "Alignment", "AlignWarning", "FunctionCheckError", "InputError", "align_checkpoints",
           "cli", "main"]
