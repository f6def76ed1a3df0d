"""What a table costs on a GPU cluster, row by row, and the full-size rehearsal of its rows.

GPU-hours anchored on measured rates (``anchors.py``, ``conf/cost.yaml``), bounded by the loader's rate
(``loader.py``): a row's hours (``rows.py``), the cost files (``render.py``), the model against published
times (``validation.py``); ``rehearsal/`` runs each row at full size (docs/cluster.md).
"""

from __future__ import annotations

from vitexp.cost.render import render_cost, summary, write_cost, write_summary
from vitexp.cost.rows import (
    DATASETS,
    KNN_METHODS,
    CostContext,
    dataset_sizes,
    rehearsal_of,
    row_cost,
    table_cost,
)

__all__ = [
    "DATASETS",
    "KNN_METHODS",
    "CostContext",
    "dataset_sizes",
    "rehearsal_of",
    "row_cost",
    "table_cost",
    "render_cost",
    "summary",
    "write_cost",
    "write_summary",
]
