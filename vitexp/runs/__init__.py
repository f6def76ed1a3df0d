"""One run's life: its owner, lock, signals, SLURM requeue, loggers, callbacks and CPU threads.

One run's life: its owner (ledger entry, closing line), lock, signals, SLURM requeue, loggers,
callbacks, CPU threads.
"""
