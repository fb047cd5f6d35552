"""`python -m worker.cli`: the `push-worker` command."""

import sys

from worker.cli import main

sys.exit(main())
