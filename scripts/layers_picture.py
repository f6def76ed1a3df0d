"""The picture of vitexp's package layers in docs/layout.md, drawn from the code.

The layers are the import-linter contract in pyproject.toml; the arrows are the imports between
packages that grimp (import-linter's graph library) finds in the source, function-level imports
included, each labelled with how many module-to-module imports it stands for. The picture is a
Mermaid flowchart (GitHub and the MkDocs site render it), written between two markers.

    python scripts/layers_picture.py           # rewrite the picture in docs/layout.md
    python scripts/layers_picture.py --check   # exit 1 when the picture is not the code's
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import grimp
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "layout.md"
BEGIN, END = "<!-- layers picture: begin -->", "<!-- layers picture: end -->"


def layers() -> list[list[str]]:
    """The contract's layers, top first, each a list of its packages (``a | b``: siblings)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contract = config["tool"]["importlinter"]["contracts"][0]
    return [[p.strip() for p in layer.replace(":", "|").split("|")] for layer in contract["layers"]]


def package_edges(top: str = "vitexp") -> Counter:
    """{(importer package, imported package): module imports} between the layers' packages."""
    packages = {p for layer in layers() for p in layer}
    graph = grimp.build_graph(top, include_external_packages=False)

    def owner(module: str) -> str | None:
        return next((p for p in packages if module == p or module.startswith(p + ".")), None)

    edges: Counter = Counter()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            a, b = owner(module), owner(imported)
            if a and b and a != b:
                edges[(a, b)] += 1
    return edges


def picture() -> str:
    """The Mermaid flowchart: one row of boxes per layer, top first, and the imports as arrows."""
    lines = ["```mermaid", "flowchart TD"]
    for i, layer in enumerate(layers()):
        lines.append(f'  subgraph L{i}[" "]')
        lines += [f"    {p.split('.', 1)[1]}[{p.split('.', 1)[1]}]" for p in layer]
        lines.append("  end")
    for (a, b), n in sorted(package_edges().items()):
        lines.append(f"  {a.split('.', 1)[1]} -->|{n}| {b.split('.', 1)[1]}")
    lines.append("```")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/layout.md's picture is stale")
    args = parser.parse_args(argv)
    text = PAGE.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    new = f"{head}{BEGIN}\n{picture()}\n{END}{tail}"
    if args.check:
        if new != text:
            print(
                f"{PAGE.relative_to(ROOT)}: the layers picture is stale; run python"
                " scripts/layers_picture.py",
                file=sys.stderr,
            )
            return 1
        return 0
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
