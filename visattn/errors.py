"""User-facing errors: each is reported as one line and a non-zero exit status, never a traceback."""


class VisattnError(Exception):
    """Base class; ``exit_code`` is the process exit status the command-line tools use."""

    exit_code = 1


class ConfigError(VisattnError, ValueError):
    """A bad config file, key, value or command-line override."""

    exit_code = 2


class DataError(VisattnError, ValueError):
    """A missing, corrupt or mislaid dataset file or folder."""

    exit_code = 2


class CheckpointError(VisattnError, ValueError):
    """A checkpoint that is missing, corrupt, unsafe to load or does not match the run."""

    exit_code = 2


class TrainingError(VisattnError, RuntimeError):
    """Training cannot go on (e.g. too many consecutive non-finite losses)."""

    exit_code = 3
