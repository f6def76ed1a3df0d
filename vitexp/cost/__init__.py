"""What a table costs on a GPU cluster, row by row: GPU-hours anchored on measured rates, bounded by
what the data loader can feed the GPU.

- :mod:`.anchors`: the measured rates (timm's benchmark files, an objective's published training time,
  a GPU measured by ``scripts/gpu_check.sh anchor``) and the GPU factor table, ``conf/cost.yaml``.
- :mod:`.loader`: a row's loader rate (``vitexp-bench bench.mode=loader``) and the workers it gets.
- :mod:`.rows`: a row's hours, the larger of its GPU time and its loader time per phase; a table's sum.
- :mod:`.render`: ``results/tables/<table>.cost.md`` and docs/cluster.md's summary.
- :mod:`.validation`: the model against published training wall clocks (DeiT, Mask R-CNN).
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
