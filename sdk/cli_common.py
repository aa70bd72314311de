"""What the `foveal` command and its `foveal batch` sub-command share: the accepted device names,
the one-line failure they print, and quiet weight loading.

Light at import (no torch, no transformers): `foveal --help` and `foveal batch --help` import it.
"""

from __future__ import annotations

import re
import sys

DEVICES = re.compile(r"auto|cpu|cuda(:\d+)?")  # what --device accepts, checked before the model loads


def check_device(device: str) -> None:
    """--device must name auto, cpu, cuda or cuda:N (whether torch has it is checked when it loads)."""
    if not DEVICES.fullmatch(device):
        raise ValueError(f"--device {device!r} is not accepted; use auto, cpu, cuda or cuda:N")


def quiet_loading() -> None:
    """No weight-loading progress bars from transformers: stderr is for foveal's own messages."""
    from transformers.utils import logging

    logging.disable_progress_bar()


def fail(error: BaseException | str, status: int) -> int:
    """Print the error as one line on stderr; the exit status to return."""
    print(f"foveal: error: {error}", file=sys.stderr)
    return status
