"""Bad inputs, table-driven (issue 29 items 6-12, issue 25 items 4-5): every case raises the
documented error class with a message that names the field or option and the fix, and a model
handed to a failing call is left exactly as it was (``tests/_state.py``).

Each row: an id, a factory for the model the call gets (or ``None``), the call, the name of
the error class in ``autoremat`` (or a builtin), and a regex the message must match.
"""

from __future__ import annotations

import builtins
import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import autoremat
from autoremat.cli import main as cli_main
from autoremat.integrations.accelerate import AutoRematConfig

from _state import assert_unchanged, snapshot


class MLP(nn.Module):
    def __init__(self, width: int = 32, depth: int = 6) -> None:
        super().__init__()
        self.l = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.l:
            x = torch.relu(layer(x))
        return x


def _mlp(width: int = 32) -> MLP:
    torch.manual_seed(0)
    return MLP(width)


def _x(batch: int = 64, width: int = 32, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(batch, width, generator=torch.Generator().manual_seed(1), dtype=dtype)


@functools.lru_cache(maxsize=None)
def _plan_dict(mode: str = "fx") -> str:
    """A real plan (as JSON text) for ``_mlp()`` at batch 64: chen at 90% recomputes."""
    with torch.random.fork_rng():  # _mlp seeds the global RNG: not the state under test
        g = autoremat.capture(_mlp(), (_x(),), mode=mode, repeats=1, warmup=0)
    return autoremat.solve(g, "100%" if mode == "module" else "90%", solver="dp-approx").to_json()


def _plan(mode: str = "fx") -> Any:
    return autoremat.Plan.from_json(_plan_dict(mode))


def _doc(**changes: Any) -> Callable[[], dict[str, Any]]:
    """The real plan's document with ``changes`` (built when the case runs, not at import)."""
    def build() -> dict[str, Any]:
        d = json.loads(_plan_dict())
        d.update(changes)
        return d
    return build


def _seg_doc(seg0: dict[str, Any]) -> Callable[[], dict[str, Any]]:
    def build() -> dict[str, Any]:
        d = json.loads(_plan_dict())
        d["segments"][0] = seg0
        return d
    return build


def _without(key: str) -> Callable[[], dict[str, Any]]:
    return lambda: {k: v for k, v in json.loads(_plan_dict()).items() if k != key}


def _from_dict(doc: Callable[[], dict[str, Any]]) -> Callable[[Any], Any]:
    return lambda _m: autoremat.Plan.from_dict(doc())


def _edited_plan(segments: list[tuple[list[int], bool]], mode: str = "fx", **options: Any) -> Any:
    """A plan object with hand-made segments (bypassing the file schema, as Python code can)."""
    p = _plan(mode)
    return autoremat.Plan([autoremat.Segment(tuple(n), r) for n, r in segments], solver="manual",
                          options={**p.options, **options}, graph_fingerprint=p.graph_fingerprint,
                          offload=p.offload, graph_mode=p.graph_mode, node_names=p.node_names,
                          tensors=p.tensors, inputs=p.inputs)


def _n() -> int:
    return len(_plan().node_names)


def _apply(plan_fn: Callable[[], Any], **kwargs: Any) -> Callable[[nn.Module], Any]:
    return lambda m: autoremat.apply(m, plan_fn(), **kwargs)


def _module_offload_plan() -> Any:
    p = _plan("module")
    names = list(p.node_names)
    names[1] = "no.such.module"
    return autoremat.Plan(p.segments, solver="manual", options=dict(p.options), graph_mode=p.graph_mode,
                          node_names=names, tensors=p.tensors, inputs=p.inputs,
                          graph_fingerprint=p.graph_fingerprint, offload=(0, 1))


def _cli(*argv: str) -> Callable[[Any], Any]:
    def run(_m: Any) -> None:
        code = cli_main(list(argv))
        raise SystemExit(code)
    return run


@dataclass
class Case:
    id: str
    model: Callable[[], nn.Module] | None
    call: Callable[[Any], Any]
    error: str
    match: str


CASES = [
    # --- plan documents (issue 29 item 10, issue 25 item 5)
    Case("recompute-string-false", None, _from_dict(_seg_doc({"nodes": [0], "recompute": "false"})),
         "PlanFormatError", r"segments\[0\]\.recompute.*JSON boolean"),
    Case("recompute-int", None, _from_dict(_seg_doc({"nodes": [0], "recompute": 0})),
         "PlanFormatError", r"segments\[0\]\.recompute"),
    Case("json-list-text", None, lambda _m: autoremat.Plan.from_json("[1, 2, 3]"),
         "PlanFormatError", r"expected a JSON object"),
    Case("text-not-a-path", None, lambda _m: autoremat.Plan.from_json("segments: 1"),
         "PlanFormatError", r"neither JSON text .* nor an existing plan file"),
    Case("missing-segments", None, _from_dict(_without("segments")),
         "PlanFormatError", r"'segments'.*required key is missing"),
    Case("segment-missing-nodes", None, _from_dict(_seg_doc({"recompute": True})),
         "PlanFormatError", r"segments\[0\]\.nodes.*required"),
    Case("segment-misspelt-key", None, _from_dict(_seg_doc({"nodes": [0], "recompute": True, "recompue": 1})),
         "PlanFormatError", r"segments\[0\]\.recompue.*unknown key"),
    Case("unknown-top-level-key", None, _from_dict(_doc(budget=5)), "PlanFormatError", r"'budget'.*unknown key"),
    Case("nodes-not-a-list", None, _from_dict(_seg_doc({"nodes": "0-3", "recompute": True})),
         "PlanFormatError", r"segments\[0\]\.nodes.*list of node ids"),
    Case("node-id-float", None, _from_dict(_seg_doc({"nodes": [0.5], "recompute": True})),
         "PlanFormatError", r"segments\[0\]\.nodes\[0\].*integer >= 0"),
    Case("node-id-negative", None, _from_dict(_seg_doc({"nodes": [-1], "recompute": True})),
         "PlanFormatError", r"integer >= 0"),
    Case("node-id-out-of-range", None, _from_dict(_seg_doc({"nodes": [0, 999], "recompute": True})),
         "PlanFormatError", r"node 999 is out of range"),
    Case("overlapping-segments", None,
         _from_dict(_doc(segments=[{"nodes": [0, 1], "recompute": True}, {"nodes": [1, 2], "recompute": False}])),
         "PlanFormatError", r"node 1 is also in segments\[0\]"),
    Case("segments-do-not-cover", None, _from_dict(_doc(segments=[{"nodes": [0, 1], "recompute": True}])),
         "PlanFormatError", r"do not cover"),
    Case("empty-segment", None, _from_dict(_doc(segments=[{"nodes": [], "recompute": True}])),
         "PlanFormatError", r"at least one node"),
    Case("budget-string", None, _from_dict(_doc(budget_bytes="lots")), "PlanFormatError", r"'budget_bytes'"),
    Case("budget-negative", None, _from_dict(_doc(budget_bytes=-5)), "PlanFormatError", r"'budget_bytes'.*>= 0"),
    Case("time-negative", None, _from_dict(_doc(predicted_extra_time_s=-1.0)),
         "PlanFormatError", r"'predicted_extra_time_s'"),
    Case("options-list", None, _from_dict(_doc(options=[1])), "PlanFormatError", r"'options'.*expected an object"),
    Case("offload-out-of-range", None, _from_dict(_doc(offload=[999])), "PlanFormatError", r"offload\[0\]"),
    Case("version-unsupported", None, _from_dict(_doc(version=999)), "PlanFormatError", r"'version'.*999"),
    Case("not-a-plan", None, _from_dict(_doc(format="autoremat.graph")), "PlanFormatError", r"not an autoremat plan"),
    # --- apply: validated before anything changes, rolled back on failure (items 6, 8, 9)
    Case("apply-wider-model", lambda: _mlp(64), _apply(_plan), "PlanMismatchError",
         r"param 'l\.0\.weight': the plan was made for float32\[32, 32\], the model has float32\[64, 64\]"),
    Case("apply-other-dtype", lambda: _mlp().double(), _apply(_plan), "PlanMismatchError",
         r"float32\[32, 32\].*float64\[32, 32\]"),
    Case("apply-larger-batch", _mlp, _apply(_plan, inputs=(_x(batch=128),)), "PlanMismatchError",
         r"128 rows, the plan was made for 64.*larger batch.*solve again"),
    Case("apply-other-feature-size", _mlp, _apply(_plan, inputs=(_x(width=16),)), "PlanMismatchError",
         r"args\[0\] is float32\[64, 16\].*float32\[64, 32\].*solve again"),
    Case("apply-other-input-dtype", _mlp, _apply(_plan, inputs=_x(dtype=torch.float64)), "PlanMismatchError",
         r"float64\[64, 32\]"),
    Case("apply-node-out-of-range", _mlp, _apply(lambda: _edited_plan([([0, 1, 999], True),
                                                                        (list(range(2, _n())), False)])),
         "PlanMismatchError", r"node 999.*capture this one and solve again"),
    Case("apply-overlapping", _mlp, _apply(lambda: _edited_plan([([0, 1, 2], True), (list(range(2, _n())), False)])),
         "PlanFormatError", r"node 2 appears in more than one segment"),
    Case("apply-reversed", _mlp, _apply(lambda: _edited_plan([(list(range(3, _n())), False), ([0, 1, 2], True)])),
         "PlanMismatchError", r"lower set.*out of order"),
    Case("apply-not-covering", _mlp, _apply(lambda: _edited_plan([([0, 1, 2], True)])),
         "PlanFormatError", r"do not cover"),
    Case("apply-bad-replay-tail", _mlp,
         _apply(lambda: _edited_plan([([0, 1, 2], True), (list(range(3, _n())), False)], replay_tails={"1": [4, []]})),
         "PlanMismatchError", r"replay_tails"),
    Case("apply-module-offload-unknown-module", _mlp, _apply(_module_offload_plan),
         "PlanMismatchError", r"offloads 'no\.such\.module'"),
    Case("apply-module-wider-model", lambda: _mlp(64), _apply(lambda: _plan("module")), "PlanMismatchError",
         r"param 'l\.0\.weight'"),
    # --- budgets (item 12)
    Case("budget-numpy-bool", None, lambda _m: autoremat.parse_budget(np.bool_(True)), "ValueError", r"bool"),
    Case("budget-numpy-float-out-of-range", None, lambda _m: autoremat.parse_budget(np.float64(7.0)),
         "ValueError", r"fraction in \(0, 1\]; give bytes as an int"),
    Case("budget-negative-size", None, lambda _m: autoremat.parse_budget("-1GB"), "ValueError", r"cannot be negative"),
    Case("accelerate-float-out-of-range", None, lambda _m: AutoRematConfig(budget=1.5), "ValueError",
         r"fraction in \(0, 1\]"),
    Case("accelerate-bool", None, lambda _m: AutoRematConfig(budget=True), "ValueError", r"a bool is not a budget"),
    Case("lightning-negative-fraction", None, lambda _m: autoremat.AutoRemat(budget=-0.5), "ValueError",
         r"fraction in \(0, 1\]"),
    Case("lightning-fraction-above-one", None, lambda _m: autoremat.AutoRemat(budget=5.0), "ValueError",
         r"fraction in \(0, 1\]"),
    Case("lightning-negative-bytes", None, lambda _m: autoremat.AutoRemat(budget=-3), "ValueError", r">= 0"),
    Case("lightning-raise-batch-size-str", None, lambda _m: autoremat.AutoRemat(raise_batch_size="yes"),
         "ValueError", r"raise_batch_size='yes' must be 'auto'"),
    Case("lightning-loss-fn-not-callable", None, lambda _m: autoremat.AutoRemat(loss_fn=3), "ValueError",
         r"loss_fn=3 must be callable"),
    Case("lightning-batch-arg-name", None, lambda _m: autoremat.AutoRemat(batch_arg_name=""), "ValueError",
         r"batch_arg_name"),
    # --- the CLI: exit 2 with one line, before any capture (item 12, issue 25 item 4)
    Case("cli-device-cuda-on-cpu-build", None, _cli("plan", "--model", "mlp", "--device", "cuda"), "SystemExit",
         r"no usable CUDA device .*; use --device cpu"),
    Case("cli-device-banana", None, _cli("plan", "--model", "mlp", "--device", "banana"), "SystemExit",
         r"not a device; give cpu, cuda"),
    Case("cli-budget-negative", None, _cli("plan", "--model", "mlp", "--budget", "-1GB"), "SystemExit",
         r"--budget: .*cannot be negative"),
    Case("cli-budget-garbage", None, _cli("plan", "--model", "mlp", "--budget", "lots"), "SystemExit",
         r"--budget: .*not understood"),
    Case("cli-out-missing-directory", None, _cli("plan", "--model", "mlp", "--out", "/nonexistent-dir/p.json"),
         "SystemExit", r"directory '/nonexistent-dir' does not exist; create it"),
    Case("cli-plot-is-a-directory", None, _cli("plan", "--model", "mlp", "--plot", "/"), "SystemExit",
         r"is a directory; give a file path"),
    Case("cli-steps-zero", None, _cli("demo", "--steps", "0"), "SystemExit", r"--steps 0: must be >= 1"),
]


def _error_class(name: str) -> type[BaseException]:
    return getattr(autoremat, name, None) or getattr(builtins, name)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    if case.id.startswith("cli-"):  # the CLI must refuse before any capture
        import autoremat.cli

        monkeypatch.setattr(autoremat.cli, "capture_within", lambda *a, **k: pytest.fail("captured before checking"))
        if "cuda-on-cpu" in case.id and torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    model = case.model() if case.model is not None else None
    before = snapshot(model) if model is not None else None
    with pytest.raises(_error_class(case.error)) as info:
        case.call(model)
    if case.error == "SystemExit":
        assert info.value.code == 2
        out = capsys.readouterr().out.strip()
        assert len(out.splitlines()) == 1 and out.startswith("error:"), out
        message = out
    else:
        message = str(info.value)
    assert re.search(case.match, message), message
    if model is not None:
        assert before is not None
        assert_unchanged(model, before)
