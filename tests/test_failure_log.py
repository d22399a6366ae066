"""``AUTOREMAT_FAILURE_LOG`` (tests/conftest.py): each failure's traceback is appended to the file
as it is reported, so a GPU run cut by the lease's time limit still says why a test failed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def test_failures_are_written_as_they_are_reported(tmp_path: Path) -> None:
    shutil.copy(Path(__file__).parent / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_cases.py").write_text("def test_fails():\n    assert 1 == 2, 'the reason'\n\n"
                                            "def test_passes():\n    pass\n")
    log = tmp_path / "failures.log"
    env = {**os.environ, "AUTOREMAT_FAILURE_LOG": str(log)}
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                           "-o", "addopts=", "-n", "0", "test_cases.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    text = log.read_text()
    assert text.count("==== ") == 1 and "test_cases.py::test_fails (call" in text and "the reason" in text
    assert "test_passes" not in text
