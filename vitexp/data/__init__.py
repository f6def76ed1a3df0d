"""Datamodules, Fashion-MNIST and its IDX files, the tensor decoder and the loader benchmark.

Datamodules, Fashion-MNIST and its IDX files, the tensor decoder, and the loader benchmark with its JPEG
folder.
"""
