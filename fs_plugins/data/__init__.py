"""Instruction data: loading, prompts and tokenisation, splitters, batch streams."""
from fs_plugins.data import splitters  # noqa: F401  (registers the splitters)
