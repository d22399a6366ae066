"""Shared pytest configuration: ``gpu``-marked tests are skipped on machines without CUDA;
``AUTOREMAT_FAILURE_LOG=<path>`` appends each failure's traceback to that file as it happens
(a lent GPU's time limit can end a run before pytest prints its summary);
``AUTOREMAT_TEST_TIME_JITTER=<seed>`` scales every measured node time of every capture by a
seeded factor in [1/4, 4], as another machine's timings would differ: a test that passes here
only for this machine's times fails under some seed (CI's machine chose another of two plans
tied in peak, and a test that assumed this one failed there)."""

from __future__ import annotations

from typing import Any

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist each worker gets one intra-op thread: two workers on two cores with
    two threads each oversubscribe the machine and slow every test several times over. So do the
    Python processes the tests start (a DDP fit's two ranks, the README's commands, fresh
    interpreters): ``OMP_NUM_THREADS=1`` in the environment they inherit."""
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each failure's traceback, written when it is reported (under pytest-xdist: by the
    controller, as each worker's report arrives), to ``AUTOREMAT_FAILURE_LOG`` when set."""
    import os

    path = os.environ.get("AUTOREMAT_FAILURE_LOG")
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"==== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n")
        for name, text in report.sections:
            if "log" in name or "stderr" in name:
                f.write(f"---- {name}\n{text[-4000:]}\n")


def jitter_times(rec: Any, meta: dict, seed: str) -> None:
    """Scale the forward and backward time of every node of a capture's recorder ``rec`` by
    factors in [1/4, 4], seeded by ``seed`` and the capture's fingerprint; measured times only
    (``meta["time_source"]``), not FLOP counts or meta captures' zeros."""
    import random

    if meta.get("time_source") not in ("perf_counter", "cuda-events"):
        return
    rng = random.Random(f"{seed}:{meta.get('fingerprint')}")
    for r in rec.nodes:
        r.time_s *= 4.0 ** rng.uniform(-1.0, 1.0)
        r.bwd_time_s *= 4.0 ** rng.uniform(-1.0, 1.0)


@pytest.fixture(autouse=True)
def _jittered_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured node times scaled per node when ``AUTOREMAT_TEST_TIME_JITTER`` is set (module docstring)."""
    import importlib
    import os

    seed = os.environ.get("AUTOREMAT_TEST_TIME_JITTER")
    if not seed:
        return
    capture_mod = importlib.import_module("autoremat.capture")  # the package (autoremat.capture is the function)
    to_graph = capture_mod._to_graph

    def jittered(rec, meta):  # type: ignore[no-untyped-def]
        jitter_times(rec, meta, seed)
        return to_graph(rec, meta)

    monkeypatch.setattr(capture_mod, "_to_graph", jittered)


@pytest.fixture(autouse=True)
def _fresh_reference_plans() -> None:
    """Each test starts with no reference plan and no chain's exact needs kept (:mod:`autoremat.solvers.stable`
    and :mod:`autoremat.solvers.milp.chain` keep them per process, by content, not by the module
    constants a test may patch)."""
    from autoremat.solvers.milp.chain import clear_shared_needs
    from autoremat.solvers.stable import clear_reference_memo

    clear_reference_memo()
    clear_shared_needs()
