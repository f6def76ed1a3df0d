"""The console scripts and each command's body, which resolves its config once and hands the parts down.

The console scripts and each command's body: compose, validate and resolve once, then hand typed parts
down.
"""
