"""Development tools, not the product: the demo, the benchmarks, the soak and their local endpoint."""
