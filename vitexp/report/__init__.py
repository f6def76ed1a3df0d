"""Table specs joined with the ledger: rows, aggregation, rendering, plots, verdicts, the results page.

Table specs joined with the ledger: rows, aggregation, rendering, plots, protocols and their prose, the
results page.
"""
