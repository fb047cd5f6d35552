"""A development tool's scratch directory (brokers' data, configs, logs: 100 MB and more a run)."""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A fresh directory, removed when the block ends; kept, and named, when it ends in an error (its
    logs tell why). Stop the processes using it inside the block."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    except BaseException:
        print(f"{prefix.rstrip('-')}: its files (logs among them) kept in {path}", file=sys.stderr)
        raise
    shutil.rmtree(path, ignore_errors=True)
