"""Instruction data: loading, prompts and tokenisation, splitters, batch streams."""
