"""Align and merge two Hugging Face checkpoints: ``attn-symmetry align`` and ``align_checkpoints``.

    attn-symmetry align MODEL_A MODEL_B --out DIR
                        [--method full|ortho|perm|naive|activation|learned] [--scope ...]
                        [--merge 0.5 [--repair]] [--match-data FILE|DIR]
                        [--eval-text FILE | --eval-images DIR] [--dtype keep|float32]
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
same function. ``align_checkpoints`` reads its options from one table
(``Options``: each option's default, flag and doc; the command's flags are generated from it
and the command builds one ``Options`` that it passes through) and runs its stages, each
announced by one progress line and timed in the report (``_clock.Clock``):

1. check (``_check.check``): the options alone (``check_options``: method, scope, merge,
   dtype, function tolerance, matching options, evaluation flags and sizes; no
   file is read), the packages the evaluation needs, then the folders
   (config, tensor names, shapes and dtypes), their
   architectures against each other, the memory budget (``_memory``), the output folder, the
   evaluation file and the match data (``--match-data``: ``_eval_files.match_batches``, the
   batches that the methods that read activations and REPAIR run the models on). Every problem
   is refused here (or, for NaN weights, while loading) with a one-line ``InputError``, before
   anything is written;
2. the source (``_sources``): where A and B are read from. Whole models (a method that is not
   streamed, ``matching.Method.streamed``; an evaluation or ``repair``) are loaded in a stage "load" (``_sources.Whole``: both models'
   float32 parameters, one stored tensor at a time); otherwise the method streams the
   checkpoints a group of tensors at a time (``_sources.Streamed``: a ``layers_i``, the
   embeddings, the final norm with the head, kept in their stored dtype and computed in
   float32);
3. align: the element g, from the source (``matching.align_model`` on whole models,
   ``matching.align_model_streamed`` on streamed ones: a round of its descent is a pass over
   the layers plus the residual's reduction; ``matching.align_activations_streamed`` for
   a method streamed by its activations: one or two passes of both models over the match batches, a layer at a time,
   ``Model.activations_streamed``), then one pass over the groups
   (``_apply.apply``; with whole models inside this stage, streamed as the stage "apply"):
   each group of leaves of A and B read, brought to ``group_action.canonical_form`` where g
   needs it, B' = g . B computed, the squared distances ||A - B||, ||A - B'|| summed per
   top-level parameter group (``layers_i``, ``embed``, ...), B' and A' rounded to the dtypes
   they are written in and written tensor by tensor into the staging folder
   (``safetensors_io.FolderWriter``: DIR/aligned_b/, B' in B's tensor names, shards and
   dtypes with every other file of B's folder, ``Checkpoint.side_files``; DIR/aligned_a/
   when A is re-parametrised; DIR/merged/ with ``merge`` and without ``repair``, (1 - merge) A' +
   merge B' in A's layout). Then the function check (``_function_check``): the logits of B and B'
   (and of A and A', when A is re-parametrised) on CHECK_BATCH random inputs of the model's kind,
   drawn from ``jax.random.key(CHECK_SEED)``. Above ``function_tolerance`` (relative to the largest
   logit; by default the square root of the written dtype's epsilon) it stops with a
   ``FunctionCheckError`` that gives the difference, and nothing is written;
4. repair (``_repair``, with ``repair``): the merge (1 - merge) A' + merge B' REPAIRed on the
   match batches (``repair.repair``: each channel's statistics reset to the interpolation of the
   endpoints', folded into the weights) and written to DIR/merged in the plain merge's stead;
5. evaluate (``_outputs.evaluate``; with an evaluation file, ``_eval_files``): loss and accuracy
   along (1 - lambda) A + lambda B ("before") and (1 - lambda) A' + lambda B'
   ("after"), and their barriers (``lmc``); with ``merge``, the merged
   model's loss and accuracy beside A's and B's (report "merged"), and the repaired one's;
6. save (``_outputs.save_curves``, with an evaluation): DIR/interpolation.json and .png.

Last, the report (``_outputs.report``) is written, DIR/report.json, in one place
(``_outputs.write_report``), and the staging folder's outputs are moved into DIR.

One gauge. RMSNorm models (Llama): an orthogonal map of the residual stream is
a symmetry only once the norm scales are folded into the weights that read them;
pre-LayerNorm models with ``--residual orthogonal`` (GPT-2, ViT, GPT-NeoX): an
O(d - 1) map only once the writers are mean-free and the gains folded, a tied
head untied first (report.json's "untied_head"). Both are
``group_action.canonical_form``. When the alignment uses one, A is
re-parametrised too: A' is A in that form (the same function), and it is A' and
B' that lie close, tensor for tensor, and are compared and merged; aligned_a/
holds A'. Otherwise A' is A itself, and aligned_b/ lies close to MODEL_A. report.json's "compare" names the two folders: ["aligned_a",
"aligned_b"] or ["MODEL_A", "aligned_b"].

Memory (``_memory``). Streamed, memory holds a few leaves of each model besides the descent's group,
not the models, and does not grow with depth. ``Alignment.params`` and ``params_a`` need A, B and
their aligned copies whole in float32: they are kept only where four float32 models fit the memory
budget (``memory_budget``, ``--memory-budget``; default the machine's memory), and the function
check then runs on them, against the sources' logits computed before the pass. Otherwise the folders
written into the staging folder are read back beside their sources a layer at a time
(``Model.apply_streamed``) and checked so, before anything is moved into DIR; without ``out`` the
check is skipped and the report's "function_check" says why. Whole models (a method that trains on the
interpolated model's loss, an evaluation and REPAIR run whole models) are refused
before any work where both do not fit the budget twice; so is a streamed alignment whose largest
group does not. With whole models, peak memory stays within 3x the two checkpoints' size
(``benchmarks/bench_align_checkpoints.py``, GPT-2 small in float32): the models are read one tensor
at a time, and without an evaluation the pass releases each group of A and B once it is done with it
(``_sources.Whole.release``); the function check keeps only B's and A's logits on its small batch;
the merged model is computed leaf by leaf as it is written; and the C heap's free pages are returned
to the system after every stage and between compiling the matching program and running it
(``runtime``). jaxlib's LAPACK kernels run on one OpenBLAS thread during the call
(``runtime.single_threaded_blas``): with OpenBLAS's own threads, matching's batched inverses made
GPT-2 small's alignment about 10x slower on 2 cores.

Outputs are written into a temporary folder inside DIR and then moved into
place; with ``overwrite`` the earlier outputs of this tool in DIR are replaced
and other files left alone. DIR may neither be nor contain nor lie inside
MODEL_A or MODEL_B, so nothing there is ever written.


The modules, in the order the stages run: ``_records`` (the options, what the stages pass one
another, the errors, the returned ``Alignment``), ``_clock`` (progress lines and seconds),
``_check``, ``_memory`` (the memory policy), ``_eval_files`` (evaluation and match batches),
``_sources`` (whole or streamed: g, the reference logits, groups of leaves), ``_apply`` (the
pass), ``_function_check``, ``_distances``, ``_repair`` (the repaired merge), ``_outputs``
(evaluate, report, the staging folder), ``_pipeline`` (``align_checkpoints``) and ``_cli`` (the
command)."""

from attn_symmetry.align._cli import cli, main
from attn_symmetry.align._function_check import CHECK_BATCH, CHECK_SEED, CHECK_TOKENS
from attn_symmetry.align._pipeline import align_checkpoints
from attn_symmetry.align._records import (DTYPES, MATCHING_OPTIONS, OUTPUTS, Alignment,
                                          AlignWarning, FunctionCheckError, InputError, Options)

__all__ = ["CHECK_BATCH", "CHECK_SEED", "CHECK_TOKENS", "DTYPES", "MATCHING_OPTIONS", "OUTPUTS",
           "Alignment", "AlignWarning", "FunctionCheckError", "InputError", "Options",
           "align_checkpoints", "cli", "main"]
