"""strata's exceptions: every error of the C++ core arrives as one of these, with its message.

The message names what went wrong and the numbers that explain it (which tensor, tier, file or
key; how much was asked and free). Subclasses also derive from the built-in exception a Python
caller would catch for the same fault (``ValueError``, ``KeyError``, ``MemoryError``, ``OSError``).
"""


class Error(Exception):
    """Base of every strata error."""


class InvalidArgumentError(Error, ValueError):
    """A bad parameter, configuration key or value, or a call the tensor's state refuses."""


class OutOfMemoryError(Error, MemoryError):
    """A tier has no room. Attributes: ``tier``, ``requested_bytes``, ``free_bytes``,
    ``largest_free_bytes`` (when the core knows them)."""


class IoError(Error, OSError):
    """A read, write, open or allocation on a file failed. Attributes: ``errno``, ``path``,
    ``offset``."""


class CorruptDataError(IoError):
    """A checksum or a file format check failed (a flipped byte, a malformed header)."""


class NotFoundError(Error, KeyError):
    """A named tensor, file or key does not exist."""

    def __str__(self) -> str:  # KeyError would quote the message
        return Exception.__str__(self)


class UnsupportedError(Error):
    """The build or the machine cannot do what was asked (a CUDA backend without a GPU)."""
