"""The README's code runs as written: its first Python block (the 30-second path) is executed,
and every ``autoremat`` sub-command it shows exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_first_python_block_runs(capsys: pytest.CaptureFixture[str]) -> None:
    code = _blocks("python")[0]
    assert "autoremat.capture" in code and "autoremat.apply" in code
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out.split("\n")
    assert "recomputed" in out[0]  # plan.describe()
    assert int(out[1]) > 0  # min_budget in bytes


def test_cli_commands_in_the_readme_exist() -> None:
    from autoremat.cli import _parser

    parser = _parser()
    subcommands = set(parser._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    shown = set(re.findall(r"`autoremat (\w+)", README)) | set(re.findall(r"\.venv/bin/autoremat (\w+)", README))
    assert shown and shown <= subcommands, shown - subcommands
