"""Style rules that a test enforces (STYLE.md 1, 5, 13, 14).

* Solvers and the layers they see (graph, plan, simulate, budget's top level) import no torch,
  neither directly nor through another autoremat module.
* No bare ``except:`` anywhere in the library.
* Every public module defines ``__all__``.
* No ``print`` outside the CLI.
* The private torch names the library uses are the listed ones, checked on torch 2.11 and 2.13.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "autoremat"

TORCH_FREE = ["graph.py", "plan.py", "plan_offload.py", "region_units.py", "plan_schema.py", "replay_tail.py", "errors.py", "_units.py", "_jsonio.py",
              "_graph_rules.py", "call_names.py"] + sorted(
    str(p.relative_to(PKG)) for folder in ("cost", "solvers") for p in (PKG / folder).rglob("*.py")
)
"""Modules that must not import torch anywhere (not even inside a function)."""

TORCH_FREE_TOP_LEVEL = ["budget.py", "offload/__init__.py", "offload/bandwidth.py"]
"""Modules that may import torch lazily inside a function, never at import time."""

ALLOWED_INTERNAL = {"autoremat.graph", "autoremat.plan", "autoremat.plan_offload", "autoremat.region_units",
                    "autoremat.plan_schema", "autoremat.cost", "autoremat.replay_tail",
                    "autoremat.errors", "autoremat.budget", "autoremat._units", "autoremat._jsonio", "autoremat.solvers",
                    "autoremat.offload", "autoremat.call_names", "autoremat._graph_rules"}
"""What torch-free modules may import from autoremat (``autoremat/__init__`` imports torch)."""

FORBIDDEN_THIRD_PARTY = {"torch", "lightning", "pytorch_lightning", "accelerate", "transformers",
                         "functorch", "pynvml"}


def _modules() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, tree: ast.AST, top_level_only: bool) -> list[tuple[int, str]]:
    """Absolute names of every module imported in ``tree`` (relative imports resolved)."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # include imports under top-level if/try blocks, not inside functions
        stack, nodes = list(tree.body), []
        while stack:
            node = stack.pop()
            nodes.append(node)
            if isinstance(node, (ast.If, ast.Try)):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    stack.extend(getattr(node, field, []) or [])
            elif isinstance(node, ast.ExceptHandler):
                stack.extend(node.body)
    out: list[tuple[int, str]] = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if node.module is None:  # "from . import x": x is a module of the package
                out.extend((node.lineno, f"{mod}.{a.name}") for a in node.names)
            else:
                out.append((node.lineno, mod))
    return out


def _violations(rel: str, top_level_only: bool) -> list[str]:
    path = PKG / rel
    bad = []
    for line, mod in _imports(path, _tree(path), top_level_only):
        root = mod.split(".")[0]
        if root in FORBIDDEN_THIRD_PARTY:
            bad.append(f"{rel}:{line} imports {mod}")
        elif root == "autoremat":
            if mod == "autoremat" or not any(mod == a or mod.startswith(a + ".") for a in ALLOWED_INTERNAL):
                bad.append(f"{rel}:{line} imports {mod}, which imports torch")
    return bad


@pytest.mark.parametrize("rel", TORCH_FREE)
def test_torch_free_modules_import_no_torch(rel):
    assert _violations(rel, top_level_only=False) == []


@pytest.mark.parametrize("rel", TORCH_FREE_TOP_LEVEL)
def test_budget_imports_no_torch_at_import_time(rel):
    assert _violations(rel, top_level_only=True) == []


def test_import_checker_catches_violations():
    fake = PKG / "solvers" / "chen.py"
    tree = ast.parse("import torch\nfrom torch.utils import checkpoint\nfrom ..capture import capture\n"
                     "from .. import runtime\nfrom ..graph import Graph\nfrom .none import solve_none\n"
                     "def f():\n    import lightning\n")
    mods = [m for _, m in _imports(fake, tree, top_level_only=False)]
    assert mods == ["torch", "torch.utils", "autoremat.capture", "autoremat.runtime", "autoremat.graph",
                    "autoremat.solvers.none", "lightning"]
    top = [m for _, m in _imports(fake, tree, top_level_only=True)]
    assert "lightning" not in top and "torch" in top


def test_solvers_run_with_torch_unimportable():
    """Import the solver stack with torch blocked and the package ``__init__`` bypassed; solve."""
    code = f"""
import sys, types, importlib.abc

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {sorted(FORBIDDEN_THIRD_PARTY)!r}:
            raise ImportError("blocked by test_style: " + name)
        return None

sys.meta_path.insert(0, Block())
pkg = types.ModuleType("autoremat")
pkg.__path__ = [{str(PKG)!r}]
sys.modules["autoremat"] = pkg
import autoremat.graph, autoremat.plan, autoremat.cost, autoremat.budget, autoremat.errors
import autoremat.solvers, autoremat.solvers.chen, autoremat.solvers.none
g = autoremat.graph.Graph.chain([100] * 12)
plan = autoremat.solvers.solve(g, "70%", solver="chen")
assert plan.recompute_segments, plan
assert autoremat.cost.simulate(g, plan).peak_bytes <= plan.budget_bytes
leaked = sorted(m for m in sys.modules if m.split(".")[0] in {sorted(FORBIDDEN_THIRD_PARTY)!r})
assert not leaked, leaked
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_no_bare_except(path):
    bare = [n.lineno for n in ast.walk(_tree(path)) if isinstance(n, ast.ExceptHandler) and n.type is None]
    assert bare == [], f"bare except: in {path.name} at lines {bare}"


def _public(path: Path) -> bool:
    parts = path.relative_to(PKG).parts
    return not any(p.startswith("_") and p != "__init__.py" for p in parts)


@pytest.mark.parametrize("path", [p for p in _modules() if _public(p)], ids=lambda p: str(p.relative_to(PKG)))
def test_public_modules_define_all(path):
    tree = _tree(path)
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name) and t.id == "__all__":
                    assert isinstance(node.value, (ast.List, ast.Tuple)), f"{path.name}: __all__ is not a literal"
                    names = {ast.literal_eval(e) for e in node.value.elts}
                    break
            else:
                continue
            break
    else:
        pytest.fail(f"{path.relative_to(PKG)} defines no __all__")
    # every name in __all__ is defined or imported at the top level
    defined = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defined.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update((a.asname or a.name).split(".")[0] for a in node.names)
    # a lazy name: imported under `if TYPE_CHECKING:` and served by a module-level __getattr__
    if "__getattr__" in defined:
        for node in tree.body:
            if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
                defined.update((a.asname or a.name) for sub in node.body if isinstance(sub, ast.ImportFrom)
                               for a in sub.names)
    assert names <= defined, f"{path.name}: __all__ names undefined {sorted(names - defined)}"


def test_public_module_list_is_not_empty():
    public = {str(p.relative_to(PKG)) for p in _modules() if _public(p)}
    assert {"graph.py", "plan.py", "cost/simulator.py", "budget.py", "solvers/chen.py"} <= public
    assert "_units.py" not in public and "capture/_recorder.py" not in public


@pytest.mark.parametrize("path", [p for p in _modules() if p.name != "cli.py"],
                         ids=lambda p: str(p.relative_to(PKG)))
def test_no_print_outside_cli(path):
    calls = [n.lineno for n in ast.walk(_tree(path))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "print"]
    assert calls == [], f"print() in {path.name} at lines {calls}: use logging or rich"


PRIVATE_TORCH = {
    "torch._C._current_graph_task_id", "torch._dynamo.eval_frame.OptimizedModule",
    "torch.nn.modules.batchnorm._BatchNorm", "torch.utils._python_dispatch.TorchDispatchMode",
    "torch.utils._pytree.tree_flatten", "torch.utils._pytree.tree_unflatten",
    "torch.distributed._composable_state",  # FSDP2's module-state registry (issue 21); in torch since 2.1
    "torch._C._current_autograd_node",  # the live-storage counter's gradient sums; torch's MemTracker uses it too
    # a meta capture dispatching as the real device (capture.device_parity, capture.shadow_values); each
    # checked in the 2.11 wheel's stubs and sources, used there by FakeTensorMode's convolution rule the same way
    "torch._fused_sdp_choice", "torch._C._select_conv_backend", "torch._C._conv_determine_backend_memory_format",
    "torch._subclasses.fake_tensor.FakeTensorMode", "torch.utils._python_dispatch._disable_current_modes",
    "torch.utils._pytree.tree_map",
    # autocast emulated on meta tensors (capture.autocast_meta): each in the 2.11 wheel's stubs and in
    # 2.13 (the DispatchKey member AutocastPrivateUse1 is in the pybind enum of python_dispatch.cpp, not
    # in either version's stubs; aten._to_copy is an ATen op)
    "torch.Tensor._make_wrapper_subclass", "torch._C.DispatchKey", "torch._C.DispatchKeySet",
    "torch._C._ExcludeDispatchKeyGuard", "torch._C._IncludeDispatchKeyGuard",
    "torch._C._dispatch_get_registrations_for_dispatch_key", "torch.ops.aten._to_copy.default",
    # whether the running backward keeps the graph (runtime.selective's retained graphs): bound in
    # torch/csrc/autograd/init.cpp, read by aot_autograd's backward since torch 2.1; present in 2.13
    "torch._C._autograd._get_current_graph_task_keep_graph",
    # whether a torch.func transform runs (runtime.transforms): torch._functorch.pyfunctorch reads it since 2.1
    "torch._C._functorch.peek_interpreter_stack",
    # parametrize.cached()'s module globals (runtime.substituted): in torch/nn/utils/parametrize.py since 1.9,
    # unchanged through 2.13 (peft and bitsandbytes set them too)
    "torch.nn.utils.parametrize._cache", "torch.nn.utils.parametrize._cache_enabled",
}
"""Private torch names the library uses, each checked to exist in torch 2.11 (the PyTorch of the GPU
machines the GPU benchmark runs on) and in the pinned 2.13. A private name can vanish between
releases (``torch._C._autograd._make_saved_tensor`` is missing from 2.11, and ``import autoremat``
failed there): before adding one here, check it on both."""


def _private_torch_names(tree: ast.AST) -> set[str]:
    """Dotted torch names with a private (``_x``, not dunder) part: attribute chains on ``torch``
    and ``from torch... import`` names."""
    found = set()

    def private(parts: list[str]) -> bool:
        return any(p.startswith("_") and not p.startswith("__") for p in parts)

    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}  # part of a longer chain
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            for alias in node.names:
                parts = [*node.module.split("."), alias.name]
                if private(parts):
                    found.add(".".join(parts))
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            parts, cur = [], node
            while isinstance(cur, ast.Attribute):
                parts.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id == "torch":
                parts = ["torch", *reversed(parts)]
                if private(parts):
                    found.add(".".join(parts))
    return found


def test_private_torch_names_are_the_checked_ones() -> None:
    used = set()
    for path in _modules():
        used |= _private_torch_names(ast.parse(path.read_text()))
    assert used == PRIVATE_TORCH, (
        f"new private torch names {sorted(used - PRIVATE_TORCH)} (check each exists in torch 2.11 and 2.13, then "
        f"add it to PRIVATE_TORCH); no longer used: {sorted(PRIVATE_TORCH - used)}")
    assert _private_torch_names(ast.parse("from torch._C._autograd import _make_saved_tensor\n"
                                          "torch._C._foo(); torch.nn.Linear; torch.__version__")) == {
        "torch._C._autograd._make_saved_tensor", "torch._C._foo"}
