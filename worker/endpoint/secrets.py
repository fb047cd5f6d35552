"""Project secrets and the operator's: where one lives (`SecretRef`), and the store that reads them
(`SecretStore`: a rotated file is seen within seconds; a project's secrets only from its own directory)."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

FILE_RECHECK_SECONDS = 10.0  # a rotated secret file (Kubernetes Secret volume) is picked up this soon


class SecretUnavailable(Exception):
    """A secret a subscription names cannot be read now (its variable unset, its file missing)."""


SECRET_NAME_RULE = "must be a secret name: 1-63 of a-z 0-9 . _ - starting with a letter or digit, without '..'"  # noqa: S105 - a rule, not a secret
_SECRET_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")


def secret_name_ok(name: str) -> bool:
    """A name that can only mean one file inside a project's directory (no separator, no `..`)."""
    return bool(_SECRET_NAME.fullmatch(name)) and ".." not in name


@dataclass(frozen=True)
class SecretRef:
    """Where a secret lives: a project's named secret (`secret` with its `project`), or, for the
    operator's config file only, an environment variable or a file."""

    env: str | None = None
    file: str | None = None
    secret: str | None = None
    project: str | None = None

    def describe(self) -> str:
        if self.secret is not None:
            return f"secret {self.secret} of project {self.project}"
        return f"env {self.env}" if self.env else f"file {self.file}"


class SecretStore:
    """Reads secrets, caching file contents briefly so a rotated file is picked up without a restart.
    `secrets_dir`: where project secrets live (`secrets.dir`), one directory per project."""

    def __init__(self, environ: Mapping[str, str] | None = None, secrets_dir: Path | None = None) -> None:
        self.environ = os.environ if environ is None else environ
        self.secrets_dir = secrets_dir
        self._files: dict[str, tuple[float, bytes]] = {}

    def read(self, ref: SecretRef) -> bytes:
        if ref.env is not None:
            value = self.environ.get(ref.env)
            if not value:
                raise SecretUnavailable(f"environment variable {ref.env} is not set")
            return value.strip().encode()
        path = self._project_file(ref) if ref.secret is not None else ref.file
        assert path is not None
        cached = self._files.get(path)
        if cached is not None and time.monotonic() - cached[0] < FILE_RECHECK_SECONDS:
            return cached[1]
        try:
            content = Path(path).read_bytes().strip()
        except OSError as e:
            raise SecretUnavailable(f"{ref.describe()}: file {path} cannot be read ({e.strerror})") from None
        if not content:
            raise SecretUnavailable(f"{ref.describe()}: file {path} is empty")
        self._files[path] = (time.monotonic(), content)
        return content

    def _project_file(self, ref: SecretRef) -> str:
        """`<secrets.dir>/<project>/<name>`, resolved; a link that leaves the project's directory is
        refused (Kubernetes' own `..data` links stay inside it)."""
        if self.secrets_dir is None:
            raise SecretUnavailable(f"{ref.describe()}: the worker has no secrets.dir to read project secrets from")
        assert ref.secret is not None and ref.project is not None
        if not secret_name_ok(ref.secret) or not secret_name_ok(ref.project):
            raise SecretUnavailable(f"{ref.describe()}: not a valid secret or project name")
        root = os.path.realpath(self.secrets_dir)
        project_dir = os.path.realpath(self.secrets_dir / ref.project)
        if not project_dir.startswith(root + os.sep):  # the project's directory is a link out of secrets.dir
            raise SecretUnavailable(f"{ref.describe()}: the project's directory links outside secrets.dir")
        path = os.path.realpath(os.path.join(project_dir, ref.secret))
        if not path.startswith(project_dir + os.sep):
            raise SecretUnavailable(f"{ref.describe()}: the file links outside the project's directory")
        return path
