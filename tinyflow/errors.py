"""The errors TinyFlow raises on purpose: the bottom of the import graph.

Every error a user can meet derives from `TinyFlowError`, so ``except
tf.TinyFlowError`` catches exactly the mistakes TinyFlow diagnosed (a bad shape, a
missing feed, a late rank), never a bug inside numpy. The base classes live here,
in a module that imports nothing of tinyflow, so that the low layers (backend,
transports, allreduce, streams) need not import the graph IR only to raise one.
Each layer defines its own subclasses beside the code that raises them
(`executor.ExecutionError`, `memory.PlanError`, `transports.CollectiveError`, ...);
graph.py re-exports the three below, where they were first defined.
"""

from __future__ import annotations


class TinyFlowError(Exception):
    """Base class of every error TinyFlow raises on purpose."""


class ShapeError(TinyFlowError, ValueError):
    """Shapes (or dtypes) that an op cannot accept. Names op, shapes and file:line."""


class FeedError(TinyFlowError, ValueError):
    """A missing, extra, or ill-shaped value in a `feed_dict`."""


class ArgumentError(TinyFlowError, TypeError, ValueError):
    """An argument of a builder that no input could make valid: an axis, stride or
    shape entry that is not an int (1.5, "1"), a keepdims that is not a bool, a dtype
    numpy does not know or a tensor cannot hold (str, object), a hyperparameter out
    of range. Names the op, the argument, the value and the user's file:line.

    Both a TypeError and a ValueError, as Python itself would raise one or the
    other for such an argument, so ``except TypeError`` / ``except ValueError``
    written for the plain errors that used to escape still catch it."""
