"""Development tools, not the product: the demo, the benchmarks, the soak and their local endpoint."""

# The sections of `python -m devtools bench`, here so that the command line offers them without importing
# the benchmark (and its dependencies) to build its parser.
BENCH_SECTIONS = ("dispatcher", "core", "concurrency", "subscriptions", "payload", "idle", "fleet", "neighbours",
                  "batch", "tracing", "spread")
