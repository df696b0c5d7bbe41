"""Checks of command-line options shared by ``python -m visattn.evaluate``, ``python -m visattn.visualize`` and the
``bench/`` scripts: each bad value is one :class:`~visattn.errors.ConfigError` line naming the flag, never a
traceback; :class:`ArgumentParser`, whose own refusals are one line too; and :func:`describe`, the ``--help``
description of every command-line tool (``bench/`` included)."""
from __future__ import annotations

import argparse
import math
import re
from typing import NoReturn, Optional, Union

import torch

from .errors import ConfigError, VisattnError


def describe(doc: str) -> str:
    """A script's ``--help`` description from its module docstring: the whole first paragraph on one line, its
    literals unquoted, without a leading ````command``:`` (the usage line argparse prints above it anyway)."""
    text = " ".join(doc.strip().split("\n\n")[0].split())
    text = re.sub(r"^``[^`]+``:\s*", "", text).replace("``", "")
    return text[:1].upper() + text[1:]


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose refusals (a flag it does not know, ``--epochs nan`` for an int flag) are one line,
    ``prog: error: ...`` and exit status 2, like every other error of the tools, not a usage block above it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def check_at_least(flag: str, value: Optional[Union[int, float]], low: Union[int, float], strict: bool = False) -> None:
    """``value >= low`` (``> low`` when ``strict``), and finite; ``None`` (a flag not given) passes; else a
    ConfigError naming ``flag`` (NaN and inf fail: ``--airbench-epochs nan`` is no number of epochs)."""
    if value is None:
        return
    if not math.isfinite(value) or (value <= low if strict else value < low):
        raise ConfigError(f"{flag} must be a finite number {'above' if strict else 'of at least'} {low}, got {value}"
                          if isinstance(value, float) else f"{flag} must be at least {low}, got {value}")


def check_range(flag: str, value: Union[int, float], low: Union[int, float], high: Union[int, float]) -> None:
    """``low <= value <= high`` (NaN fails), else a ConfigError naming ``flag``."""
    if isinstance(value, float) and math.isnan(value) or not low <= value <= high:
        raise ConfigError(f"{flag} must be between {low} and {high}, got {value}")


def resolve_device(name: str) -> torch.device:
    """The device ``name`` means: ``auto`` is CUDA where there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device: {name!r} asked for but no CUDA device is available (use device=auto or cpu)")
    return dev


def check_device(flag: str, name: str) -> torch.device:
    """The device ``name`` means (``auto``, ``cpu``, ``cuda``, ``cuda:N``), checked to exist."""
    try:
        dev = resolve_device(name)
    except VisattnError as e:
        raise ConfigError(f"{flag} {name!r}: {e}") from None
    except (RuntimeError, ValueError):
        raise ConfigError(f"{flag} {name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"{flag} {name!r}: only cpu and cuda devices are supported")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"{flag} {name!r}: there are {torch.cuda.device_count()} CUDA device(s)")
    return dev
