"""FLOPs under an explicit protocol (docs/flops.md) and throughput, interleaved."""
