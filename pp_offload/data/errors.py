"""The one exception type of the data pipeline.

Every data problem (a missing file, a missing column, too little text for one block, an unreachable hub) is a
`DataError`, so a launcher can catch this one type and print the message instead of a stack trace. It is a
`ValueError` because each of them is a bad input, not a bug.
"""

from __future__ import annotations


class DataError(ValueError):
    """Bad data or data configuration; the message says what is wrong and what would fix it."""
