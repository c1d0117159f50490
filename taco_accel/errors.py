"""The library's exceptions, one base class for all of them.

A leaf module (it imports nothing of taco_accel), so that every layer raises these and a user
catches `TacoError` for anything the library refuses. Each class also derives from the builtin
that names its kind (``ValueError`` for bad input, ``RuntimeError`` for a failed run), so code
written against the builtins keeps working.
"""

from __future__ import annotations


class TacoError(Exception):
    """Base class of every error taco_accel raises on purpose."""


class NonFiniteError(TacoError, FloatingPointError):
    """A tensor holding NaN or Inf reached the codec under ``nonfinite="raise"``."""


class GroupOverflowError(NonFiniteError):
    """A group of finite values too large for the codec's fp32 arithmetic reached `compress`
    under ``nonfinite="raise"`` (its transform sums G values: past 3.4e38 they overflow)."""


class WireFormatError(TacoError, ValueError):
    """A wire buffer read under another `TacoConfig` than the one that wrote it, or not a buffer
    of the layout it is read with."""


class CollectiveMismatch(TacoError, ValueError):
    """The ranks of a group made different calls of one collective."""


class CollectiveTimeout(TacoError, RuntimeError):
    """A collective waited longer than the group's timeout for a peer."""


class ConfigTypeError(TacoError, TypeError):
    """A setting of the wrong type: a format name or a dict where a `TacoConfig` is needed."""


class CheckpointError(TacoError, ValueError):
    """A checkpoint folder is incomplete, damaged, or does not fit this run."""


class ConfigError(TacoError, ValueError):
    """A setting (an argument, an environment variable, a launch config entry) holds a value
    the library cannot use; the message quotes it and names the valid ones."""


class EnvironmentSettingError(ConfigError):
    """A ``TACO_*`` environment variable holds a value that the library cannot use."""


class DataError(TacoError, ValueError):
    """A data file cannot be read as training data (binary, not UTF-8, malformed, corrupt); the
    message names the file (and line) and what to pass instead."""


class OutputExistsError(TacoError, FileExistsError):
    """A new run would overwrite what a previous run left in its output folder."""


class NotPicklableError(TacoError, TypeError):
    """A tensor-parallel model (or a part of it) was pickled: it holds this process's process
    groups. The message names what to save instead."""
