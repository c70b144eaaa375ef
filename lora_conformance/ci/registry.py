"""Read ``register_*_ci(...)`` calls from suite files without importing them.

Only literal arguments are accepted, so what a file registers is visible to a reader and to
this module alike; every mistake is reported as ``file:line: message``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from lora_conformance.devices import CPU, CUDA, NPU, XPU

# Suite names CI knows per hardware kind; a registration naming another suite is an error,
# so a typo cannot silently drop a file from every CI run.
DEFAULT_SUITES: tuple[str, ...] = ("per-commit", "nightly-full")
SUITES: dict[str, tuple[str, ...]] = {
    CPU: ("per-commit", "nightly-full"),
    CUDA: ("per-commit", "nightly-full", "nightly-multi-gpu"),
    XPU: ("per-commit", "nightly-full"),
    NPU: ("per-commit", "nightly-full"),
}

# A suite that runs every file of the suites it includes besides its own registrations: the
# nightly run is a superset of the per-commit run, so a file registered once for per-commit
# also runs nightly (and a nightly lane is never empty while per-commit is not).
INCLUDES: dict[str, tuple[str, ...]] = {
    "nightly-full": ("per-commit",),
}

# function name -> hardware it fixes (None: the generic form, whose first argument is hw)
FUNCTIONS: dict[str, Optional[str]] = {
    "register_ci": None,
    "register_cpu_ci": CPU,
    "register_cuda_ci": CUDA,
    "register_xpu_ci": XPU,
    "register_npu_ci": NPU,
}
_PARAMS = ("est_time", "suite", "nightly", "disabled")
_REQUIRED = ("est_time", "suite")


def suites_for(hw: str) -> tuple[str, ...]:
    return SUITES.get(hw, DEFAULT_SUITES)


def included_suites(suite: str) -> tuple[str, ...]:
    """``suite`` and every suite it includes, transitively (its own name first)."""
    out, todo = [], [suite]
    while todo:
        name = todo.pop(0)
        if name not in out:
            out.append(name)
            todo.extend(INCLUDES.get(name, ()))
    return tuple(out)


class RegistrationError(ValueError):
    """A register_*_ci call that cannot be read; the message starts with ``file:line:``."""


@dataclass(frozen=True)
class Registration:
    path: Path
    line: int
    hw: str
    suite: str
    est_time: float
    nightly: bool = False
    disabled: Optional[str] = None

    def matches(self, hw: str, suite: str, nightly: bool) -> bool:
        """Registered for this run (disabled registrations match too: callers list them).
        A suite includes the registrations of the suites it includes (INCLUDES)."""
        return self.hw == hw and self.suite in included_suites(suite) and (nightly or not self.nightly)

    def as_dict(self, root: Optional[Path] = None) -> dict:
        return {
            "file": display_path(self.path, root),
            "line": self.line,
            "hw": self.hw,
            "suite": self.suite,
            "est_time": self.est_time,
            "nightly": self.nightly,
            "disabled": self.disabled,
        }


def display_path(path: Path, root: Optional[Path] = None) -> str:
    path = Path(path)
    for base in (root, Path.cwd()):
        if base is not None:
            try:
                return path.resolve().relative_to(Path(base).resolve()).as_posix()
            except ValueError:
                pass
    return path.as_posix()


def _callee_name(call: ast.Call) -> Optional[str]:
    f = call.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):  # lora_conformance.ci.register_cpu_ci(...)
        return f.attr
    return None


def _literal(node: ast.AST, where: str, what: str):
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        raise RegistrationError(
            f"{where}: argument {what!r} must be a literal (it is read without importing the file), "
            f"got {ast.unparse(node)!r}"
        ) from None


def _check_type(value, name: str, where: str, fn: str) -> None:
    ok = {
        "hw": isinstance(value, str) and value.strip() != "",
        "est_time": isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0,
        "suite": isinstance(value, str),
        "nightly": isinstance(value, bool),
        "disabled": value is None or (isinstance(value, str) and value.strip() != ""),
    }[name]
    if not ok:
        expected = {
            "hw": "a non-empty string",
            "est_time": "a number of seconds >= 0",
            "suite": "a string",
            "nightly": "True or False",
            "disabled": "None or a non-empty reason string",
        }[name]
        raise RegistrationError(f"{where}: {fn}({name}=...) must be {expected}, got {value!r}")


def _parse_call(call: ast.Call, path: Path, fn: str) -> Registration:
    where = f"{path}:{call.lineno}"
    fixed_hw = FUNCTIONS[fn]
    params = _PARAMS if fixed_hw else ("hw",) + _PARAMS
    values: dict = {}
    if len(call.args) > len(params):
        raise RegistrationError(f"{where}: {fn}() takes at most {len(params)} arguments ({', '.join(params)})")
    for name, node in zip(params, call.args):
        if isinstance(node, ast.Starred):
            raise RegistrationError(f"{where}: {fn}() does not accept *args: arguments must be literals")
        values[name] = _literal(node, where, name)
    for kw in call.keywords:
        if kw.arg is None:
            raise RegistrationError(f"{where}: {fn}() does not accept **kwargs: arguments must be literals")
        if kw.arg not in params:
            raise RegistrationError(
                f"{where}: {fn}() got an unknown argument {kw.arg!r}; accepted: {', '.join(params)}"
            )
        if kw.arg in values:
            raise RegistrationError(f"{where}: {fn}() got argument {kw.arg!r} twice")
        values[kw.arg] = _literal(kw.value, where, kw.arg)
    for name in (("hw",) if not fixed_hw else ()) + _REQUIRED:
        if name not in values:
            raise RegistrationError(f"{where}: {fn}() is missing the required argument {name!r}")
    for name, value in values.items():
        _check_type(value, name, where, fn)
    hw = fixed_hw or values["hw"]
    known = suites_for(hw)
    if values["suite"] not in known:
        raise RegistrationError(
            f"{where}: unknown suite {values['suite']!r} for hardware {hw!r}; known suites: {', '.join(known)}"
        )
    return Registration(
        path=path, line=call.lineno, hw=hw, suite=values["suite"], est_time=float(values["est_time"]),
        nightly=values.get("nightly", False), disabled=values.get("disabled"),
    )


def collect_file(path: Path, source: Optional[str] = None) -> list[Registration]:
    """The registrations of one suite file, in source order."""
    path = Path(path)
    text = path.read_text(encoding="utf-8") if source is None else source
    try:
        tree = ast.parse(text, filename=str(path))
    except SyntaxError as exc:
        raise RegistrationError(f"{path}:{exc.lineno}: cannot parse the file: {exc.msg}") from None
    top_level = {id(stmt.value) for stmt in tree.body if isinstance(stmt, ast.Expr)}
    out: list[Registration] = []
    seen: dict[tuple[str, str], int] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        fn = _callee_name(node)
        if fn not in FUNCTIONS:
            continue
        if id(node) not in top_level:
            # Inside an if/def the call may or may not run: the static reading would lie.
            raise RegistrationError(f"{path}:{node.lineno}: {fn}() must be called as a statement at module top level")
        reg = _parse_call(node, path, fn)
        key = (reg.hw, reg.suite)
        if key in seen:
            raise RegistrationError(
                f"{path}:{reg.line}: {reg.hw!r}/{reg.suite!r} is registered twice (first at line {seen[key]})"
            )
        seen[key] = reg.line
        out.append(reg)
    out.sort(key=lambda r: r.line)
    return out


def suite_files(root: Path) -> list[Path]:
    """``test_*.py`` files under ``root`` (or ``root`` itself when it is a file), sorted."""
    root = Path(root)
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("test_*.py") if "__pycache__" not in p.parts)


def collect(paths: Iterable[Path]) -> dict[Path, list[Registration]]:
    """Registrations of every file (an empty list for unregistered files)."""
    return {Path(p): collect_file(Path(p)) for p in paths}


def select(registry: dict[Path, list[Registration]], hw: str, suite: str,
           nightly: bool = False) -> tuple[dict[Path, Registration], dict[Path, Registration]]:
    """(files to run, files registered but disabled) for one hw/suite, each with its registration."""
    run: dict[Path, Registration] = {}
    disabled: dict[Path, Registration] = {}
    order = included_suites(suite)
    for path, regs in registry.items():
        # A file registered for the suite itself and for an included one: its own registration wins.
        for reg in sorted((r for r in regs if r.matches(hw, suite, nightly)), key=lambda r: -order.index(r.suite)):
            run.pop(path, None)
            disabled.pop(path, None)
            (disabled if reg.disabled else run)[path] = reg
    return run, disabled
