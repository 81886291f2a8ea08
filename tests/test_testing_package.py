"""Test scaffolding lives in statekv.testing: no production module imports it and the production registry holds no
test model type, even once it is imported."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import statekv

PACKAGE = Path(statekv.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    """Absolute names of the modules ``path`` imports (relative imports resolved against its package)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(".__init__")
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_no_production_module_imports_the_test_scaffolding():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        if module.startswith("statekv.testing"):
            continue
        if any(name == "statekv.testing" or name.startswith("statekv.testing.") for name in _imported_modules(path)):
            offenders.append(module)
    assert offenders == []


def test_the_production_registry_holds_no_test_model_type():
    code = ("import statekv, statekv.cli, sys; from statekv.models import supported_model_types; "
            "types = supported_model_types(); product = 'statekv.testing' in sys.modules; import statekv.testing; "
            "print(sorted(types)); sys.exit(product or 'statekv_tiny_eagle' in supported_model_types())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "eagle_2_5_vl" in done.stdout  # the tiny Eagle declares Eagle2.5's own type, served by production
