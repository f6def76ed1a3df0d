"""The console scripts and each command's body: compose, validate and resolve once, then hand typed parts
down."""
