"""`python -m devtools <command>`: the demo, the benchmarks and the soak (see `devtools.cli`)."""

import sys

from devtools.cli import build_parser
from worker.cli import run

sys.exit(run(build_parser()))
