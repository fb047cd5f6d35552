"""One base error for the package; `retriable` tells callers whether trying again can help."""


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
