"""User-facing errors: each is reported as one line and a non-zero exit status, never a traceback."""


MAX_MESSAGE = 600  # characters of one error line; a message quoting a hostile input is cut there


class VisattnError(Exception):
    """Base class; ``exit_code`` is the process exit status the command-line tools use.

    ``str(e)`` is one line of at most :data:`MAX_MESSAGE` characters, whatever the message quotes."""

    exit_code = 1

    def __str__(self) -> str:
        text = " ".join(super().__str__().splitlines())
        if len(text) > MAX_MESSAGE:
            text = f"{text[:MAX_MESSAGE]}... ({len(text):,} characters in all)"
        return text


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


def run_main(main, prog: str) -> None:
    """Run a script's ``main()``; a :class:`VisattnError` (a missing or bad config, unreadable data, ...) ends
    the process with one line, ``prog: message``, and the error's exit status instead of a traceback."""
    import sys

    try:
        main()
    except VisattnError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
