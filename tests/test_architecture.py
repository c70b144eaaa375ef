"""The architecture, enforced: who may import whom, who owns which knowledge, no history in the
product, no retired module name, and a plugin module of options, hooks and fixtures only. Each
check is a function over a source tree, and each has a test showing it catches what it should (on a
small tree written for it), so a check that silently passes is itself caught."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# ---- import layers --------------------------------------------------------------------------

# module (dotted prefix) -> imports (dotted prefixes) it must not make, and why.
FORBIDDEN_IMPORTS = {
    # Reading checkpoints and writing files belong to checkpoints / fileio: these layers sit below
    # the reference and must not reach up into it (that was the hidden import cycle).
    "lora_conformance.models": ("lora_conformance.reference",),
    "lora_conformance.run_order": ("lora_conformance.reference",),
    # The owners are the bottom layer: stdlib, plus the typed errors of the engine interface.
    "lora_conformance.fileio": ("lora_conformance",),
    "lora_conformance.errors": ("lora_conformance",),
    "lora_conformance.checkpoints": ("lora_conformance.",),
    "lora_conformance.patterns": ("lora_conformance",),
    # The verdict is the judge's: it gets outputs and references and computes; it never reaches
    # up to the fixture, the engine pool, the engines or the report that shows it.
    "lora_conformance.judge": ("lora_conformance.reference", "lora_conformance.context", "lora_conformance.harness", "lora_conformance.workspace",
                               "lora_conformance.plugin", "lora_conformance.report", "lora_conformance.engines",
                               "lora_conformance.options"),
    # The engine pool starts and shares engines; it judges nothing.
    "lora_conformance.harness": ("lora_conformance.judge",),
    "lora_conformance.workspace": ("lora_conformance.judge",),
    # Engines and what they stand on never reach up to the run (options, fixture, pool, report).
    "lora_conformance.engines": ("lora_conformance.reference", "lora_conformance.options", "lora_conformance.context", "lora_conformance.harness",
                                 "lora_conformance.judge", "lora_conformance.report", "lora_conformance.plugin"),
    "lora_conformance.adapters": ("lora_conformance.reference", "lora_conformance.engines", "lora_conformance.harness",
                                  "lora_conformance.report"),
}
# A verdict is computed in lora_conformance.judge alone: outside it, no function of these names is
# defined, and the fixture's assert_* methods only hand over to its Judge (their bodies call self.judge).
VERDICT_NAMES = re.compile(r"^(assert_\w+|classify|aggregate|verify|coverage|differences|tolerance_for)$")
VERDICT_DELEGATE_MODULE = "lora_conformance.context"
# checkpoints matches rank / alpha patterns in bounded time through the stdlib-and-regex patterns module.
ALLOWED_IMPORTS = {"lora_conformance.checkpoints": ("lora_conformance.errors", "lora_conformance.patterns")}
# Only the reference itself touches its cache module; others use the package's face.
PRIVATE_MODULES = {"lora_conformance.reference.cache": "lora_conformance.reference"}

# Knowledge with one owner: a function of this name is defined only in the owner module.
OWNED_FUNCTIONS = {
    "write_json_atomic": "lora_conformance.fileio",
    "build_directory_once": "lora_conformance.fileio",
    "read_adapter_config": "lora_conformance.checkpoints",
    "read_adapter_info": "lora_conformance.checkpoints",
    "adapter_info": "lora_conformance.checkpoints",
    "split_lora_key": "lora_conformance.checkpoints",
    "_split_key": "lora_conformance.checkpoints",
    "pattern_value": "lora_conformance.checkpoints",
    "model_kind": "lora_conformance.checkpoints",
    "is_encoder": "lora_conformance.checkpoints",
    "torch_dtype": "lora_conformance.checkpoints",
}
# A string constant that means "I read this file myself": only the owner spells it.
OWNED_CONSTANTS = {"adapter_config.json": "lora_conformance.checkpoints"}
# Wrappers that keep a name (a module's, a cached method's) and ask the owner; each must import it.
DELEGATES = {("lora_conformance.engines._hf_common", "torch_dtype"),
             ("lora_conformance.reference.runner", "is_encoder")}


def _modules(root: Path, package: str = "lora_conformance"):
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        yield ".".join(parts), path, ast.parse(path.read_text(), str(path))


def _imports(module: str, tree: ast.AST, is_package: bool):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            yield node.lineno, name
            for alias in node.names:  # "from lora_conformance import reference" imports a module too
                yield node.lineno, f"{name}.{alias.name}"


def _under(name: str, prefix: str) -> bool:
    return name == prefix.rstrip(".") or name.startswith(prefix if prefix.endswith(".") else prefix + ".")


def layer_violations(root: Path) -> list[str]:
    out = []
    for module, path, tree in _modules(root):
        where = path.relative_to(root)
        for lineno, name in _imports(module, tree, path.name == "__init__.py"):
            for owner, forbidden in FORBIDDEN_IMPORTS.items():
                if not _under(module, owner):
                    continue
                for f in forbidden:
                    if (_under(name, f) or (f.endswith(".") and name.startswith(f))) and not any(
                            _under(name, a) for a in ALLOWED_IMPORTS.get(owner, ())):
                        out.append(f"{where}:{lineno}: {module} imports {name} (forbidden: {f})")
            for private, owner in PRIVATE_MODULES.items():
                if _under(name, private) and not _under(module, owner):
                    out.append(f"{where}:{lineno}: {module} imports {private} (only {owner} may)")
    return out


CHECKPOINT_FILES = {"config.json", "adapter_config.json"}  # parsed only by lora_conformance.checkpoints


def _is_json_load(call: ast.Call) -> bool:
    f = call.func
    return isinstance(f, ast.Attribute) and f.attr in ("loads", "load") and isinstance(f.value, ast.Name) \
        and f.value.id == "json"


def ownership_violations(root: Path) -> list[str]:
    out = []
    for module, path, tree in _modules(root):
        where = path.relative_to(root)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in OWNED_FUNCTIONS:
                owner = OWNED_FUNCTIONS[node.name]
                if module == owner:
                    continue
                delegates = (module, node.name) in DELEGATES and (
                    owner in ast.dump(node) or f"'{owner.rsplit('.', 1)[1]}'" in ast.dump(node))
                if not delegates:
                    out.append(f"{where}:{node.lineno}: defines {node.name} (owned by {owner})")
            elif isinstance(node, ast.Call) and _is_json_load(node) and module != "lora_conformance.checkpoints" \
                    and any(isinstance(c, ast.Constant) and c.value in CHECKPOINT_FILES for c in ast.walk(node)):
                out.append(f"{where}:{node.lineno}: parses a checkpoint file itself (use lora_conformance.checkpoints)")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in OWNED_CONSTANTS:
                owner = OWNED_CONSTANTS[node.value]
                if module != owner:
                    out.append(f"{where}:{node.lineno}: spells {node.value!r} (owned by {owner})")
    return out


def verdict_violations(root: Path) -> list[str]:
    out = []
    for module, path, tree in _modules(root):
        if _under(module, "lora_conformance.judge"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and VERDICT_NAMES.match(node.name):
                delegate = module == VERDICT_DELEGATE_MODULE and any(
                    isinstance(n, ast.Attribute) and n.attr == "judge" and isinstance(n.value, ast.Name)
                    and n.value.id == "self" for n in ast.walk(node))
                if not delegate:
                    out.append(f"{path.relative_to(root)}:{node.lineno}: {node.name} computes a verdict outside "
                               "lora_conformance.judge")
    return out


def test_only_the_judge_computes_a_verdict():
    bad = verdict_violations(ROOT)
    assert not bad, "a verdict outside the judge:\n" + "\n".join(bad)


def test_the_verdict_check_catches_what_it_should(tmp_path):
    root = _tree(tmp_path, {
        "lora_conformance/__init__.py": "",
        "lora_conformance/judge/__init__.py": "def assert_close(a, b):\n    assert a == b\n",
        "lora_conformance/context.py": "class C:\n    def assert_ok(self, x):\n        self.judge.ok(x)\n"
                                       "    def assert_own(self, x):\n        assert x\n",
        "lora_conformance/report/sum.py": "def classify(r):\n    return 'passed'\n",
    })
    bad = "\n".join(verdict_violations(root))
    assert "context.py:4: assert_own computes a verdict" in bad and "sum.py:1: classify" in bad
    assert "assert_ok" not in bad and "judge" not in bad.split(":")[0] and len(bad.splitlines()) == 2


def test_import_layers():
    bad = layer_violations(ROOT)
    assert not bad, "imports across the layers:\n" + "\n".join(bad)


def test_each_piece_of_knowledge_has_one_owner():
    bad = ownership_violations(ROOT)
    assert not bad, "knowledge outside its owner:\n" + "\n".join(bad)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


def test_the_layer_check_catches_what_it_should(tmp_path):
    root = _tree(tmp_path, {
        "lora_conformance/__init__.py": "",
        "lora_conformance/models/__init__.py": "def f():\n    from lora_conformance.reference.cache import x\n",
        "lora_conformance/adapters/__init__.py": "from lora_conformance import reference\n",
        "lora_conformance/run_order.py": "from .reference import cache\n",
        "lora_conformance/harness.py": "from lora_conformance.reference import ReferenceRunner\n"
                                       "from lora_conformance.reference.cache import key_of\n",
        "lora_conformance/checkpoints.py": "from lora_conformance.errors import AdapterFormatError\n"
                                           "from lora_conformance.models import x\n",
        "lora_conformance/judge/checks.py": "from lora_conformance.harness import Harness\n",
        "lora_conformance/engines/x.py": "from lora_conformance.options import OPTIONS\n",
        "lora_conformance/fileio.py": "import json\n",
        "lora_conformance/reference/__init__.py": "from lora_conformance.reference.cache import ReferenceCache\n",
        "lora_conformance/reference/cache.py": "from lora_conformance.fileio import write_json_atomic\n",
    })
    bad = "\n".join(layer_violations(root))
    assert "models imports lora_conformance.reference.cache (forbidden" in bad
    assert "adapters imports lora_conformance.reference" in bad
    assert "run_order imports lora_conformance.reference" in bad
    assert "harness imports lora_conformance.reference.cache (only lora_conformance.reference may)" in bad
    assert "checkpoints imports lora_conformance.models" in bad
    assert "judge.checks imports lora_conformance.harness" in bad and "engines.x imports lora_conformance.options" in bad
    # allowed: the harness uses the reference's face, the owners import what they may
    assert "harness imports lora_conformance.reference (" not in bad
    assert "errors" not in bad and "fileio" not in bad and "reference/__init__" not in bad


def test_the_ownership_check_catches_what_it_should(tmp_path):
    root = _tree(tmp_path, {
        "lora_conformance/__init__.py": "",
        "lora_conformance/checkpoints.py": "C = 'adapter_config.json'\ndef pattern_value(): pass\n",
        "lora_conformance/judge/hypotheses.py": "import json\ndef _config(d):\n"
                                          "    return json.loads((d / 'adapter_config.json').read_text())\n",
        "lora_conformance/engines/adapter.py": "def pattern_value(p, m, d): return d\n"
                                               "MSG = f'rank in adapter_config.json'\n",
        "lora_conformance/engines/vllm_engine.py": "import json\ndef f(d):\n"
                                                   "    return json.loads((d / 'config.json').read_text())\n"
                                                   "FILES = ('config.json', 'tokenizer.json')\n",
        # a listed delegate that decides by itself instead of asking the owner
        "lora_conformance/harness.py": "class H:\n    def model_kind(self, d):\n        return 'decoder'\n",
        "lora_conformance/reference/runner.py": "class R:\n    def is_encoder(self):\n"
                                                "        from lora_conformance.checkpoints import model_kind\n"
                                                "        return model_kind(self.d) == 'encoder'\n",
    })
    bad = "\n".join(ownership_violations(root))
    assert "harness.py:2: defines model_kind" in bad
    assert "vllm_engine.py:3: parses a checkpoint file itself" in bad
    assert "vllm_engine.py:4" not in bad  # naming the file (a hash list) is not parsing it
    assert "runner.py" not in bad
    assert "judge/hypotheses.py:3: spells 'adapter_config.json'" in bad
    assert "engines/adapter.py:1: defines pattern_value" in bad
    assert "checkpoints.py" not in bad
    assert "engines/adapter.py:2" not in bad  # a message naming the file is not a reader of it


# ---- PEFT's scaling rule: one copy ---------------------------------------------------------------

SCALING_OWNER = "lora_conformance.checkpoints"  # module_rank_alpha / scaling_rule / peft_scaling


def _mentions_alpha(node: ast.AST) -> bool:
    return any((isinstance(n, ast.Name) and "alpha" in n.id.lower())
               or (isinstance(n, ast.Attribute) and "alpha" in n.attr.lower())
               or (isinstance(n, ast.Constant) and n.value == "lora_alpha") for n in ast.walk(node))


def _rslora_denominator(node: ast.AST) -> bool:
    """``(sqrt(r) if rs else r)``: the rsLoRA choice, whatever the numerator is called."""
    def is_sqrt(n):
        f = getattr(n, "func", None)
        return isinstance(n, ast.Call) and getattr(f, "id", getattr(f, "attr", None)) == "sqrt"
    return isinstance(node, ast.IfExp) and (is_sqrt(node.body) or is_sqrt(node.orelse))


def scaling_rule_violations(root: Path) -> list[str]:
    """Divisions that compute PEFT's scaling outside its owner: an alpha divided by anything, or
    anything divided by the rsLoRA choice ``(sqrt(r) if rs else r)`` (its defaults and patterns were
    copied with it, and one copy got the default of a missing lora_alpha wrong)."""
    out = []
    for module, path, tree in _modules(root):
        if module == SCALING_OWNER:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and (
                    _mentions_alpha(node.left) or _rslora_denominator(node.right)):
                out.append(f"{path.relative_to(root)}:{node.lineno}: computes a LoRA scaling itself "
                           f"({ast.unparse(node)[:80]}; use {SCALING_OWNER})")
    return out


def test_peft_s_scaling_rule_has_one_owner():
    bad = scaling_rule_violations(ROOT)
    assert not bad, "PEFT's scaling rule outside its owner:\n" + "\n".join(bad)


def test_the_scaling_rule_check_catches_what_it_should(tmp_path):
    root = _tree(tmp_path, {
        "lora_conformance/__init__.py": "",
        "lora_conformance/checkpoints.py": "def scaling_rule(r, a, rs):\n    return a / (sqrt(r) if rs else r)\n",
        "lora_conformance/engines/ov.py": "def s(info):\n    return float(info.raw.get('lora_alpha', 8)) / info.rank\n",
        "lora_conformance/engines/plan.py": "import math\ndef of(am, rm, rs):\n"
                                            "    return am / (math.sqrt(rm) if rs else rm)\n",
        "lora_conformance/engines/cpp.py": "def f(s, alpha, r):\n    return s / (alpha / r)\n",
        "lora_conformance/models/norm.py": "import math\ndef f(x, n):\n    return x / math.sqrt(n) + x.mean() / n\n",
    })
    bad = "\n".join(scaling_rule_violations(root))
    assert "engines/ov.py:2: computes a LoRA scaling itself" in bad
    assert "engines/plan.py:3: computes a LoRA scaling itself" in bad
    assert "engines/cpp.py:2: computes a LoRA scaling itself" in bad
    assert "checkpoints.py" not in bad and "norm.py" not in bad  # the owner; a norm's sqrt is no scaling
    assert len(bad.splitlines()) == 3, bad


# ---- no history in the product --------------------------------------------------------------

# Where the product lives; reports/ is the lab notebook and may carry dates and runs.
PRODUCT = ("lora_conformance", "suites", "tests", "docs", "ci", "bench", ".ci", "pyproject.toml",
           "README.md", "conftest.py")
TEXT_SUFFIXES = {".py", ".md", ".toml", ".yml", ".yaml", ".sh", ".txt", ".cfg", ".ini", ""}
HISTORY = re.compile(r"\b(issue|session|stop)s?\s+#?[0-9]+|\b20[0-9]{2}-[01][0-9]-[0-3][0-9]\b", re.I)
REPORT_PATH = re.compile(r"reports/[\w.\-/]+")  # links into reports/ name a dated file: fine


def _text_files(root: Path, places=PRODUCT):
    """(path, text) of the product's text files under ``places`` (files or folders), in order."""
    for place in places:
        base = root / place
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file()) if base.is_dir() else []
        for path in files:
            if path.suffix not in TEXT_SUFFIXES or "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text()
            except UnicodeDecodeError:
                continue
            yield path, text


def history_mentions(root: Path, places=PRODUCT) -> list[str]:
    out = []
    for path, text in _text_files(root, places):
        for n, line in enumerate(text.splitlines(), 1):
            m = HISTORY.search(REPORT_PATH.sub("", line))
            if m:
                out.append(f"{path.relative_to(root)}:{n}: {m.group(0)!r}: {line.strip()[:120]}")
    return out


def test_no_issue_or_session_numbers_or_dates_in_the_product():
    """Say what, not when: measurements and campaigns go to reports/, method to docs/."""
    bad = history_mentions(ROOT)
    assert not bad, "history inside the product (move it to reports/, or say what instead of when):\n" + "\n".join(bad)


N, DAY = "12", "2026-" + "12-01"  # spelled apart, so this file does not trip its own check


@pytest.mark.parametrize("line, caught", [
    (f"# fixed in issue {N}", True), (f"(Issue #{N})", True), (f"session {N}'s tree", True),
    (f"Sessions {N} and 4", True), (f"stop {N} of the campaign", True), (f"measured {DAY} on the H200", True),
    (f"see [the run](reports/{DAY}-h200.md)", False), ("vllm#16668", False),
    (f"https://github.com/o/r/issues/{N}", False), ("openvino 2026.4.1", False), ("a pytest session", False),
])
def test_the_history_check_catches_what_it_should(tmp_path, line, caught):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "x.md").write_text(f"text\n{line}\n")
    found = history_mentions(tmp_path, ("docs",))
    assert bool(found) == caught, found
    if caught:
        assert found[0].startswith("docs/x.md:2: ")


def test_reports_are_the_only_exempt_place(tmp_path):
    assert "reports" not in PRODUCT
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "run.md").write_text(f"session {N}, {DAY}\n")
    (tmp_path / "README.md").write_text(f"see reports/{DAY}-run.md (session {N})\n")
    assert history_mentions(tmp_path) == [f"README.md:1: 'session {N}': see reports/{DAY}-run.md (session {N})"]


# ---- names that say what a module holds ----------------------------------------------------

# Retired module names -> the module that holds that knowledge now. The old names misled (the
# paired-effect check was "conformance", adapter hypotheses sat beside the Hypothesis library's
# profile under a near-identical name, the test order was a "schedule" beside the engine's
# scheduler); none may come back, as a module, an import or a path in the product's text.
RETIRED_MODULES = {
    "conformance": "judge/paired",
    "hypotheses": "judge/hypotheses",
    "paired_effects": "judge/paired",
    "adapter_hypotheses": "judge/hypotheses",
    "compare": "judge",
    "suite_hypothesis": "hypothesis_profile",
    "schedule": "run_order",
}
PACKAGE = "lora_conformance"


def _retired_name(old: str) -> re.Pattern:
    return re.compile(rf"\b{PACKAGE}[./]{old}\b(?!\.(yml|yaml))|\bfrom {PACKAGE} import (\w+, )*{old}\b")


def retired_module_mentions(root: Path, places=PRODUCT) -> list[str]:
    out = []
    for old, new in RETIRED_MODULES.items():
        if (root / PACKAGE / f"{old}.py").exists():
            out.append(f"{PACKAGE}/{old}.py: a module under a retired name (it is {PACKAGE}/{new}.py)")
    patterns = {old: _retired_name(old) for old in RETIRED_MODULES}
    for path, text in _text_files(root, places):
        for n, line in enumerate(text.splitlines(), 1):
            for old, pattern in patterns.items():
                if pattern.search(line):
                    out.append(f"{path.relative_to(root)}:{n}: names {PACKAGE}.{old} "
                               f"(now {PACKAGE}.{RETIRED_MODULES[old]}): {line.strip()[:100]}")
    return out


def test_retired_module_names_stay_retired():
    bad = retired_module_mentions(ROOT)
    assert not bad, "a retired module name is back:\n" + "\n".join(bad)


def test_the_retired_name_check_catches_what_it_should(tmp_path):
    pkg = PACKAGE
    root = _tree(tmp_path, {
        f"{pkg}/__init__.py": "",
        f"{pkg}/schedule.py": "",
        f"{pkg}/harness.py": f"from {pkg} import conformance\nfrom {pkg}.hypotheses import standard\n"
                              f"from {pkg} import paired_effects, adapter_hypotheses\n",
        "suites/test_x.py": f"from {pkg}.suite_hypothesis import given\n",
        "docs/method.md": f"judged by `{pkg}/conformance.py`; workflows/conformance.yml; {pkg}/run_order.py\n",
    })
    bad = "\n".join(retired_module_mentions(root, (pkg, "suites", "docs")))
    assert f"{pkg}/schedule.py: a module under a retired name" in bad
    assert f"{pkg}/harness.py:1: names {pkg}.conformance" in bad
    assert f"{pkg}/harness.py:2: names {pkg}.hypotheses" in bad
    assert f"{pkg}/harness.py:3: names {pkg}.paired_effects" in bad
    assert f"suites/test_x.py:1: names {pkg}.suite_hypothesis" in bad
    assert f"docs/method.md:1: names {pkg}.conformance" in bad and len(bad.splitlines()) == 7


# ---- the plugin module: options, hooks and fixtures ----------------------------------------------

PLUGIN_MODULE = "lora_conformance/plugin.py"


def _is_fixture(node: ast.AST) -> bool:
    return any("fixture" in ast.dump(d) for d in getattr(node, "decorator_list", ()))


def plugin_shape_violations(root: Path) -> list[str]:
    """What the plugin module holds besides pytest hooks (``pytest_*``), fixtures and the private
    helpers its hooks call: settings, markers, checks and session services belong to their owners."""
    tree = ast.parse((root / PLUGIN_MODULE).read_text())
    out = []
    for node in tree.body:
        where = f"{PLUGIN_MODULE}:{node.lineno}"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if not (node.name.startswith("pytest_") or _is_fixture(node) or node.name.startswith("_")):
                out.append(f"{where}: defines {node.name} (neither a hook nor a fixture: give it to its owner)")
        elif isinstance(node, ast.ClassDef):
            out.append(f"{where}: defines class {node.name} (give it to its owner)")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            names = [t.id for t in getattr(node, "targets", [getattr(node, "target", None)]) if isinstance(t, ast.Name)]
            out.append(f"{where}: holds {', '.join(names) or 'a value'} (a table or key belongs to its owner)")
    return out


def test_the_plugin_holds_options_hooks_and_fixtures_only():
    bad = plugin_shape_violations(ROOT)
    assert not bad, "the plugin module holds more than options, hooks and fixtures:\n" + "\n".join(bad)


def test_the_plugin_shape_check_catches_what_it_should(tmp_path):
    root = _tree(tmp_path, {PLUGIN_MODULE: (
        "import pytest\n"
        "KEY = pytest.StashKey()\n"
        "def pytest_configure(config):\n    _helper(config)\n"
        "def _helper(config):\n    pass\n"
        "@pytest.fixture\ndef lora():\n    pass\n"
        "def resolve_settings(config):\n    pass\n"
        "class Thing:\n    pass\n")})
    bad = "\n".join(plugin_shape_violations(root))
    assert f"{PLUGIN_MODULE}:2: holds KEY" in bad
    assert f"{PLUGIN_MODULE}:10: defines resolve_settings" in bad
    assert f"{PLUGIN_MODULE}:12: defines class Thing" in bad
    assert len(bad.splitlines()) == 3, bad


# ---- no import circles ----------------------------------------------------------------------------
# Modules that import each other (directly or round a longer circle) cannot be read, tested or moved
# one at a time. The built-in engine's internals may still (its argument table, kernels and variants;
# its Llama and MoE layers); nowhere else. A submodule importing its own package's face is no circle.
CIRCLES_ALLOWED_UNDER = "lora_conformance.engines.builtin"


def import_circles(root: Path) -> list[list[str]]:
    mods = {m: (p, t) for m, p, t in _modules(root)}
    graph: dict[str, set] = {m: set() for m in mods}
    for m, (p, t) in mods.items():
        for _, name in _imports(m, t, p.name == "__init__.py"):
            parts = name.split(".")
            while parts and ".".join(parts) not in mods:
                parts.pop()
            target = ".".join(parts)
            if target and target != m and not m.startswith(target + "."):
                graph[m].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [c for c in circles if not all(_under(m, CIRCLES_ALLOWED_UNDER) for m in c)]


def test_no_import_circles_outside_the_builtin_engine():
    assert not import_circles(ROOT), "modules that import each other: " + "; ".join(
        " <-> ".join(c) for c in import_circles(ROOT))


def test_the_circle_check_catches_what_it_should(tmp_path):
    root = _tree(tmp_path, {
        "lora_conformance/__init__.py": "",
        "lora_conformance/a.py": "def f():\n    from lora_conformance import b\n",
        "lora_conformance/b.py": "from lora_conformance.c import x\n",
        "lora_conformance/c.py": "from lora_conformance.a import f\n",
        "lora_conformance/pkg/__init__.py": "from lora_conformance.pkg.inner import y\n",
        "lora_conformance/pkg/inner.py": "from lora_conformance.pkg import z\n",
        "lora_conformance/engines/__init__.py": "",
        "lora_conformance/engines/builtin/__init__.py": "",
        "lora_conformance/engines/builtin/p.py": "from lora_conformance.engines.builtin.q import x\n",
        "lora_conformance/engines/builtin/q.py": "from lora_conformance.engines.builtin.p import y\n",
    })
    assert import_circles(root) == [["lora_conformance.a", "lora_conformance.b", "lora_conformance.c"]]
