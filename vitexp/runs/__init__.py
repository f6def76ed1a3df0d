"""One run's life: its owner (ledger entry, closing line), lock, signals, SLURM requeue, loggers, callbacks,
CPU threads."""
