"""Errors shared by every layer (a leaf module: it imports nothing of the package)."""
from __future__ import annotations

import difflib


def closest_spelling(value: str, candidates) -> str | None:
    """The candidate closest to a mistyped `value` (difflib ratio >= 0.6), for "did you mean"."""
    close = difflib.get_close_matches(str(value), [str(c) for c in candidates if str(c)], n=1, cutoff=0.6)
    return close[0] if close else None


class ConfigError(ValueError):
    """One or more configuration problems, one line each, every line naming its key (or file,
    client, tensor) and, where it helps, the value and what is allowed."""
    heading = 'config error'

    def __init__(self, problems):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__('\n'.join(self.problems))

    def report(self) -> str:
        """What a command prints for it instead of a traceback."""
        return f'fs-plugins: {self.heading}:\n' + '\n'.join(f'  {p}' for p in self.problems)


class DataFileError(ConfigError):
    """A problem with a user's data file, naming the file, the line or record and what to
    change (a field of the record, or the config key). A ConfigError, so that every command
    and FederatedScope's error report print it the same way: no traceback, non-zero exit."""
    heading = 'data file error'
