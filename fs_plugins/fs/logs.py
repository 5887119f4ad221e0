"""Logging under FederatedScope."""
from __future__ import annotations

import logging


def share_fs_logging() -> None:
    """fs_plugins' log lines (data split, saved models and their bytes, FLAME's a/S summary)
    go where FederatedScope's go: FS configures only its own 'federatedscope' logger (console
    and exp_print.log), so without this they would be dropped below WARNING."""
    fs_logger, ours = logging.getLogger('federatedscope'), logging.getLogger('fs_plugins')
    if not fs_logger.handlers:
        return
    for handler in fs_logger.handlers:
        if handler not in ours.handlers:
            ours.addHandler(handler)
    ours.setLevel(fs_logger.level)
    ours.propagate = False   # the same handlers must not print a line twice via the root
