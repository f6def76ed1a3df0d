"""The package layout (docs/layout.md): few top-level entries, each package's job in its docstring,
and the layers picture drawn from today's code."""

import ast
import subprocess
import sys

from vitexp import PROJECT_ROOT

PACKAGE = PROJECT_ROOT / "vitexp"


def test_the_top_level_holds_at_most_15_entries():
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    assert len(entries) <= 15, entries


def test_every_package_states_its_job_in_one_line():
    for init in sorted(PACKAGE.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.split("\n\n")[0].splitlines()) == 1, init.relative_to(PROJECT_ROOT)


def test_every_module_docstring_is_at_most_ten_lines():
    """A module says its job in a few lines and names the page that holds its reasoning (docs/)."""
    long = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        body = ast.parse(path.read_text()).body
        if (
            body
            and isinstance(body[0], ast.Expr)
            and isinstance(getattr(body[0], "value", None), ast.Constant)
        ):
            if (n := body[0].end_lineno - body[0].lineno + 1) > 10:
                long[str(path.relative_to(PROJECT_ROOT))] = n
    assert not long, long


def test_the_layers_picture_is_the_codes():
    result = subprocess.run(
        [sys.executable, str(PROJECT_ROOT / "scripts" / "layers_picture.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_importing_the_package_registers_its_architectures_with_timm():
    code = "import timm, vitexp; print(sorted(timm.list_models('vit_micro*')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "vit_micro_patch4_32" in result.stdout, result.stderr[-500:]
