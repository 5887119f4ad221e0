"""Errors shared by every layer (a leaf module: it imports nothing of the package)."""
from __future__ import annotations


class ConfigError(ValueError):
    """One or more configuration problems, one line each, every line naming its key (or file,
    client, tensor) and, where it helps, the value and what is allowed."""

    def __init__(self, problems):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__('\n'.join(self.problems))
