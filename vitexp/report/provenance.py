"""Provenance rules for the papers' values in table specs (``sweeps/*.yaml``; the
docs/cluster.md): a paper cell is ``{value, source, derived, formula}``. ``source`` names the
document and the place the number was read, the publication of the method the number belongs to,
never a second-hand citation ("EViT README, Model Zoo", "MCTF (Lee et al., CVPR 2024), README Model
Zoo, ...; checked against the README (...)"), and says "unchecked" where the value was not compared
with that publication; a value the paper gives only through arithmetic (a gain added to a baseline:
72.2 + 1.3 = 73.5) is ``derived: true`` with its ``formula``, which must evaluate to the value.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

#: How a table or plot marks a derived paper value (its formula goes in a footnote).
DERIVED_MARK = "†"

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
#: a source that shows a sum or difference of numbers ("81.5 + 0.9") describes a derived value
_ARITHMETIC = re.compile(r"\d\s*[+−-]\s*\d")
#: a source that shows a signed gain ("(+2.0)", "−0.4 over") describes a derived value too
_GAIN = re.compile(r"(?<![\w.])[+−]\s*\d")


def evaluate_formula(formula: str) -> float:
    """The value of an arithmetic formula of numbers, + − × / and parentheses ("72.2 + 1.3")."""

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(f"formula {formula!r}: only numbers, + - * / and parentheses are allowed")

    return float(ev(ast.parse(formula.replace("−", "-").replace("×", "*"), mode="eval").body))


def provenance_errors(spec: dict[str, Any]) -> list[str]:
    """What breaks the provenance rules in a spec's paper values (empty: none): a value without a
    source, a derived value without a formula or whose formula does not give the value, and a
    source that shows arithmetic ("81.5 + 0.9") on a value not marked derived."""
    problems = []
    for row in spec["rows"]:
        for key, cell in (row.get("paper") or {}).items():
            where = f"{row.get('label')!r} {key}"
            if not isinstance(cell, dict) or "value" not in cell:
                problems.append(f"{where}: a paper cell is {{value, source}}")
                continue
            if not str(cell.get("source") or "").strip():
                problems.append(f"{where}: no source")
            if cell.get("derived"):
                formula = str(cell.get("formula") or "").strip()
                if not formula:
                    problems.append(f"{where}: derived without a formula")
                elif abs(evaluate_formula(formula) - float(cell["value"])) > 1e-9 * max(
                    1.0, abs(cell["value"])
                ):
                    problems.append(
                        f"{where}: formula {formula} = {evaluate_formula(formula):g}, not {cell['value']}"
                    )
            elif _ARITHMETIC.search(str(cell.get("source") or "")) or _GAIN.search(
                str(cell.get("source") or "")
            ):
                problems.append(
                    f"{where}: the source shows arithmetic or a gain; mark it derived: true with its formula"
                )
    return problems
