"""Progress of autoremat's long phases (capture, solve, trial steps, timing), with names and
elapsed time.

On a terminal a phase is a ``rich`` progress line with a spinner and its elapsed time, kept
(with its total time) when it ends. Anywhere else (a log file, CI, a job scheduler's output) a
phase is plain lines on standard error: ``autoremat: capture resnet50 ...`` when it starts, a
line per step it reports, a line every ``heartbeat_s`` seconds while it runs (a DenseNet demo
once ran 30 minutes without a line), and ``autoremat: capture resnet50: done in 3.2 s`` when it
ends (``failed after`` on an exception). ``AUTOREMAT_PROGRESS=0`` turns it off;
``Progress(enabled=False)`` too (the integrations pass their ``verbose`` flag and rank).

Standard error, so that what a command prints on standard output (tables, JSON) stays clean.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from rich.console import Console

__all__ = ["Progress", "Phase", "fmt_seconds", "progress_enabled"]

DEFAULT_HEARTBEAT_S = 60.0


def fmt_seconds(seconds: float) -> str:
    """``0.42 s``, ``3.2 s``, ``2 min 05 s``, ``1 h 02 min``."""
    if seconds < 1:
        return f"{seconds:.2f} s"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, sec = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {sec:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def progress_enabled() -> bool:
    """``AUTOREMAT_PROGRESS`` unset or true (``0``, ``false``, ``no``, ``off``: off)."""
    return os.environ.get("AUTOREMAT_PROGRESS", "1").strip().lower() not in ("0", "false", "no", "off")


class Phase:
    """A running phase: :meth:`step` reports where it is (``"pair 3/7"``)."""

    def __init__(self, owner: "Progress", name: str) -> None:
        self.owner = owner
        self.name = name
        self.start = time.perf_counter()
        self.detail = ""
        self._task: Any = None

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start

    def step(self, detail: str) -> None:
        """Say where the phase is; a terminal updates its line, other output gets a line."""
        self.detail = detail
        if not self.owner.enabled:
            return
        if self._task is not None:
            self.owner._live.update(self._task, description=f"{self.name}: {detail}")
        else:
            self.owner.line(f"{self.name}: {detail} ({fmt_seconds(self.elapsed_s)})")


class Progress:
    """Named phases with elapsed time (module docstring)."""

    def __init__(self, enabled: bool | None = None, *, console: Console | None = None,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S, prefix: str = "autoremat") -> None:
        self.enabled = progress_enabled() if enabled is None else bool(enabled) and progress_enabled()
        self.console = console or Console(stderr=True)
        self.heartbeat_s = heartbeat_s
        self.prefix = prefix
        self._live: Any = None
        self._open = 0

    def line(self, text: str) -> None:
        """One plain line (not on a terminal, or between phases)."""
        if self.enabled:
            self.console.print(f"{self.prefix}: {text}", markup=False, highlight=False, soft_wrap=True)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[Phase]:
        """Run a named phase; its end (or failure) and elapsed time are reported."""
        phase = Phase(self, name)
        if not self.enabled:
            yield phase
            return
        if self.console.is_terminal:
            with self._terminal(phase):
                yield phase
            return
        self.line(f"{name} ...")
        stop = threading.Event()
        beat = threading.Thread(target=self._heartbeat, args=(phase, stop), daemon=True)
        beat.start()
        try:
            yield phase
        except BaseException:
            stop.set()
            self.line(f"{name}: failed after {fmt_seconds(phase.elapsed_s)}")
            raise
        finally:
            stop.set()
            beat.join()
        self.line(f"{name}: done in {fmt_seconds(phase.elapsed_s)}")

    def _heartbeat(self, phase: Phase, stop: threading.Event) -> None:
        while not stop.wait(self.heartbeat_s):
            where = f" ({phase.detail})" if phase.detail else ""
            self.line(f"{phase.name}: still running after {fmt_seconds(phase.elapsed_s)}{where}")

    @contextlib.contextmanager
    def _terminal(self, phase: Phase) -> Iterator[None]:
        from rich.progress import Progress as RichProgress
        from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

        if self._live is None:
            self._live = RichProgress(SpinnerColumn(finished_text="[green]✓"), TextColumn("{task.description}"),
                                      TimeElapsedColumn(), console=self.console, transient=False)
            self._live.start()
        self._open += 1
        phase._task = self._live.add_task(phase.name, total=None)
        failed = False
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            done = "failed" if failed else "done"
            self._live.update(phase._task, description=f"{phase.name}: {done} in {fmt_seconds(phase.elapsed_s)}",
                              total=1, completed=1)
            self._open -= 1
            if self._open == 0:
                self._live.stop()
                self._live = None
