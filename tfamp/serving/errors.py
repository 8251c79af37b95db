"""The one error ``tfamp export`` raises for what it cannot do, with what to do instead."""

from __future__ import annotations


class ExportError(ValueError):
    """An export that cannot be done or checked; nothing was written.

    The message says what was expected, what was found and how to proceed.
    """
