"""autoremat against what a PyTorch user would pick instead, on the same model, batch and machine.

    python benchmarks/compare                                     # full CPU run, ~25 min on 2 cores
    python benchmarks/compare --models resnet50,gpt2 --rounds 3
    python benchmarks/compare --quick --out /tmp/compare          # smoke mode: one tiny model, 1 round
    python benchmarks/compare --batch-only                        # only the largest-batch section, merged
                                                                  # into the existing compare.json

For every model (zoo ``resnet50``, ``densenet121``, ``unet`` at CPU size, and a transformers GPT-2
from a small config with random weights and tokens) each configuration runs on a fresh deepcopy of
the same model and the same batch:

* ``none``: no checkpointing (the reference);
* ``block-ac``: per-block full checkpointing as Lightning's FSDP strategy and Accelerate do it
  (``apply_activation_checkpointing`` with a non-reentrant ``checkpoint_wrapper`` on every block);
* ``block-sac``: the same blocks under selective activation checkpointing that saves the outputs
  of ``aten.mm``/``addmm``/``bmm``/``convolution`` and recomputes the rest;
* ``compile@B``: ``torch.compile`` with ``torch._functorch.config.activation_memory_budget = B``
  (1.0, 0.75, 0.5, 0.25); compile time is reported apart from step time;
* ``ckpt-seq``: ``torch.utils.checkpoint.checkpoint_sequential`` where the model is a sequence;
* ``save-on-cpu``: ``torch.autograd.graph.save_on_cpu`` (everything saved is copied to the host;
  on a CPU-only machine that is a copy in the same memory);
* ``autoremat:<solver>@<f>``: autoremat with every registered solver at budgets of 75 %, 50 % and
  30 % of the measured unoptimised step peak, and ``autoremat:<solver>@match`` at the lowest step
  peak an eager PyTorch option measured (equal-peak comparison; ``--no-match`` leaves it out);
* ``autoremat:<solver>@<f>+torch-regions``: the same plan as ``autoremat:<solver>@<f>`` run with
  ``apply(..., regions="torch")`` (``torch.utils.checkpoint`` regions instead of autoremat's own),
  for ``--torch-regions`` (default ``dp-approx@0.5``; ``none`` leaves it out);
* ``autoremat:<solver>@<f>+compile``: the patched model under ``torch.compile`` (``--compile-backend``,
  ``activation_memory_budget`` 1.0): each recomputed region is traced as PyTorch's checkpoint
  operator and the compiled backward recomputes it; for ``--compiled-plans`` (default
  ``dp-approx@0.5,dp-approx@0.3``: where the 30 % plan exists it shows how far below compile's own
  lowest peak a plan takes a compiled model; ``none`` leaves it out). Its peak is measured, not predicted: the simulator
  models eager PyTorch.

Metrics: the measured step peak (``autoremat.measure``: a live-storage counter on the CPU, the
caching allocator on CUDA), the median step time with all configurations of a model interleaved
round-robin over ``--rounds`` rounds in one process (so machine drift hits all of them alike),
ratios of both to ``none``, for autoremat the predicted peak, prediction error and solver time, and
a gradient check against ``none`` (``torch.equal``; ``torch.compile`` may differ numerically, so its
rows report the largest absolute difference). Then the largest batch that fits one fixed memory
budget: autoremat's ``AutoRemat(raise_batch_size=True, budget=<bytes>)`` against Lightning's
``BatchSizeFinder(mode="binsearch")`` on ``LitClassifier`` (resnet50) and ``LitGPT2``, the budget
enforced by a simulated out-of-memory (see ``SimulatedDevice``).

Writes ``compare.json``, ``RESULTS.md`` and ``compare_<model>.png`` under ``--out``
(default ``benchmarks/results/cpu``). ``benchmarks/compare_gpu.py`` runs the same on a CUDA GPU.

One module per concern: :mod:`.settings` (paths, defaults, row schemas), :mod:`.workloads` (the
models), :mod:`.runners` (one per configuration), :mod:`.measuring` (peak, time, gradients),
:mod:`.solving` (solves in a forked child with a time limit), :mod:`.model` (every configuration of
one model), :mod:`.batch` (the largest-batch comparison and its simulated device), :mod:`.report`
(headline, ``RESULTS.md``, plots), :mod:`.driver` (the run, partial results, ``--batch-only``,
``--render``) and :mod:`.cli` (the command line). The names other scripts use are re-exported here.
"""

from __future__ import annotations

from .batch import SimulatedDevice, batch_tasks, run_batch_task
from .cli import main, options_from, parser
from .driver import batch_failures, render, row_failures, run, run_batch_only, run_batch_section, write_outputs
from .model import Options, planned_configurations, run_model, solvers_to_run
from .report import headline, machine_info, plot, to_markdown
from .settings import (
    AUTOREMAT_BUDGETS, BATCH_FIELDS, BATCH_METHODS, COMPILE_BUDGETS, DEFAULT_MODELS, DEFAULT_OUT, QUICK_MODELS,
    ROOT, ROW_FIELDS,
)
from .solving import solve_limited
from .workloads import Workload, build_workload

__all__ = [
    "AUTOREMAT_BUDGETS", "BATCH_FIELDS", "BATCH_METHODS", "COMPILE_BUDGETS", "DEFAULT_MODELS", "DEFAULT_OUT", "Options",
    "QUICK_MODELS", "ROOT", "ROW_FIELDS", "SimulatedDevice", "Workload", "batch_failures", "batch_tasks",
    "build_workload", "headline", "machine_info", "main", "options_from", "parser", "planned_configurations",
    "plot", "render", "row_failures", "run", "run_batch_only", "run_batch_section", "run_batch_task", "run_model",
    "solve_limited", "solvers_to_run", "to_markdown", "write_outputs",
]
