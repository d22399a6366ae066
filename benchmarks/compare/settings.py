"""Paths, defaults and the row schemas of the comparison (every row carries ``ROW_FIELDS``)."""

from __future__ import annotations

from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "cpu"

DEFAULT_MODELS = ("resnet50", "densenet121", "unet", "gpt2")
QUICK_MODELS = ("mlp",)
COMPILE_BUDGETS = (1.0, 0.75, 0.5, 0.25)
AUTOREMAT_BUDGETS = (0.75, 0.5, 0.3)
GPT2_SMALL = {"n_layer": 4, "n_embd": 64, "n_head": 4, "vocab_size": 256, "n_positions": 64}
GPT2_PAPER = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
GRAD_SEED = 1234
SAC_SAVED_OPS = ("mm", "addmm", "bmm", "convolution")
"""aten ops whose outputs selective checkpointing saves (everything else is recomputed)."""

ROW_FIELDS = (
    "model", "config", "family", "label", "status", "error", "note",
    "measured_peak_bytes", "peak_ratio", "step_time_s", "time_ratio", "step_times_s",
    "gradients_equal", "grad_max_abs_diff",
    "compile_budget", "compile_backend", "compile_s",
    "solver", "budget_fraction", "budget_bytes", "meets_budget", "predicted_peak_bytes",
    "prediction_error", "solver_time_s", "min_budget_bytes", "segments", "recomputed",
)
"""Every configuration row carries these keys (``None`` where a field does not apply)."""

BATCH_METHODS = ("autoremat", "batchsizefinder")
BATCH_FIELDS = (
    "task", "method", "status", "error", "budget_bytes", "resident_bytes", "initial_batch_size",
    "batch_size", "largest_trained_batch", "confirmed", "confirm_peak_bytes", "search_s", "note",
    "step_budget_bytes", "predicted_overhead",
)
