"""A DebugRecord's scalar series as TensorBoard event files.

Users who follow their runs in TensorBoard should see TinyFlow's there too:
`write_scalars` writes every series of the record's ``scalars`` section (the training
loss, accuracy, anything `tf.debug.scalar` logged) as a TensorBoard scalar summary,
one tag per series, with the series' own step numbers. The event files are written by
tensorboardX's `SummaryWriter` (the ``tensorboard`` extra), the library that owns the
format, and read by TensorBoard itself (``tensorboard --logdir DIR``) or its event
reader. `tinyflow export FILE --tensorboard DIR` calls it.
"""

from __future__ import annotations

import math
import os
from typing import Any

from tinyflow.trace import RecordError

__all__ = ["write_scalars"]


def write_scalars(record: dict, logdir: str | os.PathLike) -> dict[str, int]:
    """Write the record's scalars to a new event file in `logdir`; {tag: points}.

    A value that was not finite (stored as null) is written as NaN, which TensorBoard
    shows as a gap in the curve, so a diverged run is visible as such. Raises
    RecordError when the record has no scalars, when `logdir` is a file, or when
    tensorboardX is not installed.
    """
    scalars: dict[str, Any] = record.get("scalars") or {}
    if not any(scalars.values()):
        raise RecordError("the record has no scalar series to export (record some with "
                          "tf.debug.scalar(name, step, value), or train with --trace)")
    if os.path.exists(logdir) and not os.path.isdir(logdir):
        raise RecordError(f"{os.fspath(logdir)} is a file; --tensorboard needs a folder")
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise RecordError("exporting to TensorBoard needs tensorboardX: "
                          "pip install 'tinyflow[tensorboard]'") from None
    # In step order across the series, as a live run would have logged them (an event
    # file whose steps go backwards reads as a restarted run to TensorBoard's tools).
    points = sorted(((int(step), tag, value) for tag, series in scalars.items()
                     for step, value in series), key=lambda point: point[0])
    with SummaryWriter(logdir=os.fspath(logdir)) as writer:
        for step, tag, value in points:
            writer.add_scalar(tag, math.nan if value is None else float(value),
                              global_step=step)
    return {tag: len(series) for tag, series in scalars.items() if series}
