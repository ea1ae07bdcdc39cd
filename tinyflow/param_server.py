"""Parameter server: workers push gradients to server ranks and pull parameters back.

Before allreduce took over, distributed training ran on parameter servers (Li et al.
2014, ps-lite; DistBelief before it; d2l.ai's chapter explains both). Some ranks are
**servers**: together they hold the parameters, sharded as a key-value store (here
the flat vector of all parameters, cut with `chunk_bounds`: server j owns chunk j).
The other ranks are **workers**: each computes gradients on its part of the batch,
**pushes** chunk j of them to server j, and **pulls** the parameters back.

* **Synchronous** SGD: a server waits for every worker's push, averages the
  gradients, updates its shard once, and answers every pull with the new values. It
  computes exactly what one rank does with the whole batch.
* **Asynchronous** SGD with bounded staleness: a server applies each worker's
  gradient as soon as it is its turn (it visits the workers in a fixed rotation)
  and answers that worker's pull at once, so a worker computes its next gradient on
  parameters that miss at most W-1 other workers' updates. Each gradient is scaled
  by 1/W, so a round of W updates moves as far as one synchronous step (with the
  full rate, W stale updates per step overshoot and training diverges). It converges, but is not
  equal to synchronous training (documented; the tests check that it learns). A real
  parameter server takes pushes in arrival order; the rotation keeps ours
  deterministic for the lesson.

The server's update rule is the optimizer's, in numpy: SGD (var -= lr * g) or
momentum (v = mu v + g; var -= lr * v), the same operations, in the same order, as
tf.train's. Messages go through the transports like every collective, so a server
that dies is a CollectiveError on the workers naming it within the timeout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from tinyflow.allreduce import chunk_bounds
from tinyflow.graph import Node, TinyFlowError
from tinyflow.transports import Transport

__all__ = ["ParameterServer"]


class ParameterServer:
    """The key-value store over `comm`: ranks 0..servers-1 serve, the rest work.

    variables     the model's trainable Variables, in the same order on every rank
    servers       how many ranks serve (at least 1, fewer than comm.size)
    mode          "sync" or "async"
    learning_rate, momentum   the servers' update rule (momentum 0: plain SGD)

    Servers call `serve(steps)`; workers call `start(session)` once (rank `servers`
    sends the initial parameters, every worker pulls them) and `step(session, grads)`
    per step with their gradient values (from session.run of tf.gradients).
    """

    def __init__(self, comm: Transport, variables: Sequence[Node], servers: int = 1,
                 mode: str = "sync", learning_rate: float = 0.1, momentum: float = 0.0,
                 dtype: Any = np.float64) -> None:
        if not 1 <= servers < comm.size:
            raise TinyFlowError(f"a parameter server needs 1 <= servers < ranks "
                                f"({comm.size}), got {servers}")
        if mode not in ("sync", "async"):
            raise ValueError(f"mode must be 'sync' or 'async', got {mode!r}")
        self.comm, self.variables, self.servers, self.mode = comm, list(variables), servers, mode
        self.lr, self.momentum = learning_rate, momentum
        self.dtype = np.dtype(dtype)
        self.workers = list(range(servers, comm.size))
        self.total = sum(math.prod(v.shape) for v in self.variables)
        self.bounds = chunk_bounds(self.total, servers)

    @property
    def is_server(self) -> bool:
        return self.comm.rank < self.servers

    def _chunk(self, flat: np.ndarray, server: int) -> np.ndarray:
        lo, hi = self.bounds[server]
        return flat[lo:hi]

    # -- servers ----------------------------------------------------------------------
    def serve(self, steps: int) -> np.ndarray:
        """Hold this server's shard for `steps` steps of every worker; return it."""
        me = self.comm.rank
        lo, hi = self.bounds[me]
        shard = np.empty(hi - lo, self.dtype)
        self.comm.recv(self.workers[0], shard, "ps init")
        self.comm.exchange([(w, shard) for w in self.workers], [], "ps init pull")
        velocity = np.zeros_like(shard)
        for step in range(steps):
            tag = f"ps {self.mode} step {step}"
            if self.mode == "sync":
                pushed = [np.empty_like(shard) for _ in self.workers]
                self.comm.exchange([], list(zip(self.workers, pushed)), tag)
                grad = pushed[0]
                for other in pushed[1:]:
                    grad += other
                grad /= len(self.workers)
                self._update(shard, grad, velocity)
                self.comm.exchange([(w, shard) for w in self.workers], [], tag)
            else:
                for worker in self.workers:  # one at a time: bounded staleness W-1
                    grad = np.empty_like(shard)
                    self.comm.recv(worker, grad, tag)
                    grad /= len(self.workers)  # W updates move as far as one sync step
                    self._update(shard, grad, velocity)
                    self.comm.send(worker, shard, tag)
        return shard

    def _update(self, shard: np.ndarray, grad: np.ndarray, velocity: np.ndarray) -> None:
        if self.momentum:
            np.multiply(velocity, self.momentum, out=velocity)
            velocity += grad
            grad = velocity
        shard -= self.lr * grad

    # -- workers ----------------------------------------------------------------------
    def start(self, session: Any) -> None:
        """First worker: send the initial parameters to the servers. Every worker:
        pull them, so all start equal."""
        if self.comm.rank == self.workers[0]:
            flat = self._flat([session.variables[v] for v in self.variables])
            self.comm.exchange([(s, self._chunk(flat, s)) for s in range(self.servers)],
                               [], "ps init")
        fresh = np.empty(self.total, self.dtype)
        self.comm.exchange([], [(s, self._chunk(fresh, s)) for s in range(self.servers)],
                           "ps init pull")
        self._set(session, fresh)

    def step(self, session: Any, step: int, grads: Sequence[np.ndarray]) -> None:
        """Push this worker's gradients (one per variable, a mean over its examples),
        pull the updated parameters into the Session's Variables."""
        flat = self._flat(grads)
        fresh = np.empty_like(flat)
        tag = f"ps {self.mode} step {step}"
        self.comm.exchange([(s, self._chunk(flat, s)) for s in range(self.servers)], [], tag)
        self.comm.exchange([], [(s, self._chunk(fresh, s)) for s in range(self.servers)],
                           tag)
        self._set(session, fresh)

    def _flat(self, arrays: Sequence[np.ndarray]) -> np.ndarray:
        return np.concatenate([np.asarray(a, self.dtype).reshape(-1) for a in arrays])

    def _set(self, session: Any, flat: np.ndarray) -> None:
        offset = 0
        for var in self.variables:
            count = math.prod(var.shape)
            session.variables[var][...] = flat[offset:offset + count].reshape(var.shape)
            offset += count
