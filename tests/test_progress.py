"""autoremat.progress: named phases with elapsed time, as terminal progress or as log lines."""

from __future__ import annotations

import io
import time

import pytest
from rich.console import Console

from autoremat.progress import Progress, fmt_seconds


def _plain() -> tuple[Progress, io.StringIO]:
    out = io.StringIO()
    return Progress(enabled=True, console=Console(file=out, force_terminal=False, width=200)), out


def test_lines_when_not_on_a_terminal() -> None:
    progress, out = _plain()
    with progress.phase("capture resnet50") as phase:
        phase.step("timing step 2/3")
    lines = out.getvalue().splitlines()
    assert lines[0] == "autoremat: capture resnet50 ..."
    assert lines[1].startswith("autoremat: capture resnet50: timing step 2/3 (")
    assert lines[2].startswith("autoremat: capture resnet50: done in ") and lines[2].endswith(" s")


def test_heartbeat_while_a_phase_runs_long() -> None:
    progress, out = _plain()
    progress.heartbeat_s = 0.05
    with progress.phase("solve") as phase:
        phase.step("dp-approx")
        time.sleep(0.3)
    assert "autoremat: solve: still running after" in out.getvalue()
    assert "(dp-approx)" in out.getvalue()


def test_failure_is_reported_and_raised() -> None:
    progress, out = _plain()
    with pytest.raises(RuntimeError, match="boom"), progress.phase("trial steps"):
        raise RuntimeError("boom")
    assert "autoremat: trial steps: failed after" in out.getvalue()


def test_terminal_progress_keeps_each_phase_with_its_time() -> None:
    out = io.StringIO()
    progress = Progress(enabled=True, console=Console(file=out, force_terminal=True, width=100))
    with progress.phase("capture"):
        pass
    with progress.phase("solve"):
        pass
    text = out.getvalue()
    assert "capture: done in" in text and "solve: done in" in text


def test_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    progress, out = _plain()
    monkeypatch.setenv("AUTOREMAT_PROGRESS", "0")
    quiet = Progress(enabled=True, console=progress.console)
    with quiet.phase("capture") as phase:
        phase.step("x")
    quiet.line("hello")
    silent = Progress(enabled=False, console=progress.console)
    with silent.phase("capture"):
        pass
    assert out.getvalue() == ""


@pytest.mark.parametrize(("seconds", "text"), [(0.4, "0.40 s"), (3.21, "3.2 s"), (125, "2 min 05 s"),
                                               (3720, "1 h 02 min")])
def test_fmt_seconds(seconds: float, text: str) -> None:
    assert fmt_seconds(seconds) == text
