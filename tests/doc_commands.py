"""The commands of docs/cluster.md, and the one way tests run them.

A command is a line of a fenced ``bash`` block (a trailing ``\\`` joins the next line; a ``#`` comment
after two spaces is dropped). :func:`run_doc` runs one, given as its text on the page with its
placeholders (``<folder>``, ``<job id>``) filled in, and fails when the page has no such command;
tests/test_cluster_docs.py checks that every command of the page is the literal first argument of a
``run_doc`` call in the tests, so no command is on the page that no test runs.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "cluster.md"


def commands(page: Path = PAGE) -> list[str]:
    """The page's commands, in order (module docstring)."""
    out: list[str] = []
    for block in re.findall(r"^```bash\n(.*?)^```", page.read_text(), flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s{2,}#.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(re.sub(r"\s+", " ", line))
    return out


def run_doc(
    command: str,
    placeholders: dict[str, str] | None = None,
    then: str = "",
    background: bool = False,
    **kwargs,
):
    """Run the page's ``command`` in bash with ``placeholders`` filled in, then ``then`` in the same shell
    (``export`` lines); keyword arguments are ``subprocess.run``'s (``env``, ``cwd``, ``timeout``),
    output captured as text. ``background``: started, its ``Popen`` returned."""
    assert command in commands(), f"not a command of {PAGE.name}: {command!r}"
    for key, value in (placeholders or {}).items():
        assert key in command, f"{key} is not a placeholder of {command!r}"
        command = command.replace(key, value)
    argv = ["bash", "-c", f"{command}\n{then}" if then else command]
    if background:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    return subprocess.run(argv, capture_output=True, text=True, **kwargs)


def run_by_tests(folder: Path = ROOT / "tests") -> set[str]:
    """Every literal first argument of a ``run_doc(...)`` call in the tests."""
    found = set()
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "run_doc"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                found.add(node.args[0].value)
    return found
