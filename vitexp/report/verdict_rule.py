"""The verdict rule: one definition of each label a claim cell can get, with the start as the unit of
replication, and the statistics across starts.

Its reasoning and the labels' definitions: docs/verdicts.md.
"""

from __future__ import annotations

import math
from statistics import mean, stdev
from typing import Any, Hashable, Mapping, Sequence

SUPPORTS, CONTRADICTS, UNDECIDED = "supports", "contradicts", "undecided"
NONE_ABOVE, NONE_BELOW = "none above zero", "none below zero"
SPLIT_DEPENDENT, ONE_SPLIT = "split-dependent", "one split only"
NOT_RUN, INCOMPLETE = "not run", "incomplete"
#: The signs that decide a split.
DECIDED = (SUPPORTS, CONTRADICTS)

#: {label: its definition}: the tables' legends, the prose and docs/verdicts.md print these words.
DEFINITIONS: dict[str, str] = {
    SUPPORTS: "every pair above 0, from every start, on every split judged",
    CONTRADICTS: "every pair below 0, from every start, on every split judged",
    NONE_ABOVE: "no pair above 0 and at least one exactly 0 (no gain, not a clean loss)",
    NONE_BELOW: "no pair below 0 and at least one exactly 0 (no loss, not a clean gain)",
    UNDECIDED: "pairs of both signs (within a start or across starts), or the splits on neither side",
    SPLIT_DEPENDENT: "each split decided (supports or contradicts), with opposite signs",
    ONE_SPLIT: "one split decided (supports or contradicts), the other not",
    INCOMPLETE: "fewer starts than the protocol needs, or a start with fewer pairs than it needs",
}
#: Labels in the order a verdict lists them.
ORDER = (SUPPORTS, CONTRADICTS, NONE_ABOVE, NONE_BELOW, UNDECIDED, ONE_SPLIT, SPLIT_DEPENDENT)


def sign(pairs: Sequence[float], needed: int = 1) -> str:
    """A split's sign over its pairs (:data:`DEFINITIONS`); ``not run`` without pairs, ``incomplete``
    with fewer than ``needed``."""
    if not pairs:
        return NOT_RUN
    if len(pairs) < needed:
        return INCOMPLETE
    if all(p > 0 for p in pairs):
        return SUPPORTS
    if all(p < 0 for p in pairs):
        return CONTRADICTS
    if all(p <= 0 for p in pairs):
        return NONE_ABOVE
    if all(p >= 0 for p in pairs):
        return NONE_BELOW
    return UNDECIDED


def both(test: str, val: str | None) -> str:
    """One protocol's label from the test split's sign and the validation split's (``None``: no
    validation split is judged)."""
    if val is None or test in (NOT_RUN, INCOMPLETE):
        return test
    if val in (NOT_RUN, INCOMPLETE):
        return INCOMPLETE
    if test == val:
        return test
    decided = [s in DECIDED for s in (test, val)]
    if all(decided):
        return SPLIT_DEPENDENT
    return ONE_SPLIT if any(decided) else UNDECIDED


def directed(label: str, test: str, val: str | None) -> str:
    """``label`` with the way each split points where the label alone does not say it (split-dependent,
    one split only): two protocols agree only where their splits point the same way."""
    if label not in (SPLIT_DEPENDENT, ONE_SPLIT) or val is None:
        return label
    return f"{label} (test {test}, val {val})"


def complete(groups: Mapping[Hashable, Sequence[float]], starts: int, pairs: int, own: bool) -> bool:
    """Whether a split's pairs, grouped by start, are enough to judge: at least ``starts`` starts, each
    with ``pairs`` pairs; where every seed is its own start (``own``: no shared start), ``pairs`` counts
    the starts."""
    if own:
        return len(groups) >= max(starts, pairs)
    return len(groups) >= starts and all(len(p) >= pairs for p in groups.values())


#: Two-sided 95 % quantiles of Student's t for 1-10 degrees of freedom (scipy.stats.t.ppf(0.975, df)).
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def across_starts(groups: Mapping[Hashable, Sequence[float]]) -> dict[str, Any]:
    """The statistics of pairs grouped by start: ``starts`` (their number), ``means`` (each start's
    mean pair), ``mean`` and ``std`` across the start means (degrees of freedom: starts − 1),
    ``half95`` (the 95 % t interval's half-width across starts; ``None`` below two starts or above
    ten), ``within`` (the pooled standard deviation of the pairs around their start's mean; ``None``
    without a start of two pairs) and ``pairs`` (their number)."""
    means = [mean(p) for p in groups.values() if p]
    k = len(means)
    sd = stdev(means) if k > 1 else None
    resid = [(x - mean(p)) ** 2 for p in groups.values() for x in p]
    df = sum(len(p) for p in groups.values()) - k
    return {
        "starts": k,
        "means": means,
        "mean": mean(means) if means else None,
        "std": sd,
        "half95": T975[k - 2] * sd / math.sqrt(k) if sd is not None and k - 1 <= len(T975) else None,
        "within": math.sqrt(sum(resid) / df) if df > 0 else None,
        "pairs": sum(len(p) for p in groups.values()),
    }


def legend(two_splits: bool, starts: bool, noun: str = "protocol") -> str:
    """The labels' definitions as one paragraph (the legend of a claim table and its prose)."""
    shown = [SUPPORTS, CONTRADICTS, NONE_ABOVE, NONE_BELOW, UNDECIDED]
    shown += [SPLIT_DEPENDENT, ONE_SPLIT] if two_splits else []
    words = "; ".join(f"{label}: {DEFINITIONS[label]}" for label in shown)
    unit = (
        " A start is the run whose weights a row's runs loaded (`backbone.pretrained=run:...`, one"
        " start per weights file otherwise); a row trained from nothing makes each seed its own start."
        f" A claim holds under a {noun} only where it holds from every start."
        if starts
        else ""
    )
    return f"{words}.{unit}"


def verdict(signs: list[tuple[str, str]], noun: str = "protocol") -> str:
    """One claim's verdict from ``(column label, label)`` pairs: a verdict only where the measured
    columns agree; ``noun``: what a column is (``protocol``, ``backbone``)."""
    measured = [(p, s) for p, s in signs if s not in (NOT_RUN, INCOMPLETE)]
    incomplete = sum(s == INCOMPLETE for _, s in signs)
    of = f"{len(measured)} of {len(signs)} {noun}s measured" + (
        f", {incomplete} incomplete" if incomplete else ""
    )
    if not measured:
        return f"no {noun} measured yet ({of})" if incomplete else f"not run ({of})"
    so_far = " so far" if len(measured) < len(signs) else ""  # a column still to come may disagree
    kinds = {s for _, s in measured}
    if kinds == {SUPPORTS}:
        return f"holds under every measured {noun}{so_far} ({of})"
    if kinds == {CONTRADICTS}:
        return f"fails under every measured {noun}{so_far} ({of})"
    if len(kinds) == 1:
        return f"{kinds.pop()} under every measured {noun}{so_far} ({of})"

    def rank(kind: str) -> tuple[int, str]:
        base = kind.split(" (", 1)[0]
        return (ORDER.index(base) if base in ORDER else len(ORDER), kind)

    parts = [f"{s} under {', '.join(p for p, k in measured if k == s)}" for s in sorted(kinds, key=rank)]
    return f"{noun}s disagree: {'; '.join(parts)} ({of})"
