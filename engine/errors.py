"""Typed errors. Each one names what was wrong, so a handler can turn it into a job error as is."""


class EngineError(Exception):
    """Base class for every error the engine raises on purpose."""


class ModelNotFoundError(EngineError):
    """The model is neither a local folder nor cached; the message lists every path searched."""


class UnsupportedModelError(EngineError):
    """The checkpoint exists but we cannot load it (pickle-only weights, unknown architecture, ...)."""


class InvalidRequestError(EngineError, ValueError):
    """A request the engine will not run: bad sampling params, empty or over-long prompt.

    `field` names the offending input (e.g. "temperature", "prompt") so callers can report it."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class ConfigError(EngineError, ValueError):
    """An EngineConfig value that cannot work; the message names the field.

    `field` is the EngineConfig field at fault ("block_size", or "speculative_config.model" inside a nested
    config), so handler/settings.py can name the environment variable without reading the message; None when no
    single field is (a model that does not fit the memory)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class EngineFault(EngineError):
    """The step loop failed (a bug, a device error, a step that hung past STEP_TIMEOUT_S). In-flight requests end
    with this; the engine refuses new work, and the worker should be replaced."""


class RequestFault(EngineError):
    """One request failed inside a step for a reason that is not its input's fault, while the others run on: it did
    not fit in device memory even with the step's batch halved (`status` 503), or the model gave its row NaN or
    infinite logits (500). `field` names what to send smaller, where something would help."""

    def __init__(self, message: str, status: int = 500, field: str | None = None):
        super().__init__(message)
        self.status = status
        self.field = field
