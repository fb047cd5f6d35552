"""One base error for the package; `retriable` tells callers whether trying again can help."""

import re

_USERINFO = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://)[^/\s@]*@")
_BARE_USERINFO = re.compile(r"(?<![\w/.:-])[^\s/@:'\"]*:[^\s/@'\"]*@(?=[\w\[])")  # `user:pw@host`, no scheme


def strip_userinfo(text: str) -> str:
    """`text` with the credentials of every URL in it removed (`redis://:pw@host` -> `redis://host`,
    `user:pw@host` -> `host`): an error that quotes a URL must not print its password."""
    return _BARE_USERINFO.sub("", _USERINFO.sub(r"\1", text))


class PushWorkerError(Exception):
    """Base of every error this package raises on purpose."""

    retriable = False


class ConfigError(PushWorkerError):
    """A configuration or subscription definition breaks a rule; the message names field and rule."""

    def __init__(self, where: str, field: str, rule: str) -> None:
        self.where = where
        self.field = field
        self.rule = rule
        location = f"{where}: " if where else ""
        super().__init__(f"{location}{field}: {rule}")


class ConfigErrors(ConfigError):
    """Several rules broken in one configuration: every one of them, so that `check` names them all
    at once (the first also as this error's own fields)."""

    def __init__(self, errors: list[ConfigError]) -> None:
        self.errors = errors
        first = errors[0]
        super().__init__(first.where, first.field, first.rule)
        self.args = ("; ".join(str(e) for e in errors),)


class UsageError(ConfigError):
    """A command's argument breaks a rule (exit code 2, like a bad configuration, but said as such)."""


class DestinationRefused(PushWorkerError, OSError):
    """A push URL points at an address the destination policy does not allow."""


class InfrastructureError(PushWorkerError):
    """Redis or the broker failed; the operation may succeed when tried again."""

    retriable = True


class StartupError(PushWorkerError):
    """The worker cannot start, and waiting will not help (e.g. Redis refused the credentials)."""


class NotFound(PushWorkerError):
    """What an operator command asked about does not exist (or is no longer kept)."""
