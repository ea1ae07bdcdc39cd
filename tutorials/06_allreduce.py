# %% [markdown]
# # Lesson 6: data parallelism and ring allreduce
#
# Data-parallel training runs the same model on N workers ("ranks"), each on its
# own slice of the batch. After the backward pass every rank holds gradients of
# its slice; before the update, every rank needs their **sum** (or mean), so that
# all replicas take the same step. That collective is *allreduce*.
#
# The obvious way, everyone sends to rank 0, which adds and sends the sum back,
# makes rank 0 move 2(N-1) whole arrays while the others wait. The *ring*
# (Patarasuk & Yuan 2009; Baidu 2017, then Horovod and NCCL) makes every rank send
# only 2(N-1)/N of the array, whatever N is.
#
# In this lesson you will
#
# 1. run 4 ranks as threads of this process and allreduce with both algorithms;
# 2. count the bytes each rank sends;
# 3. read the ring's recorded steps: reduce-scatter, then all-gather.
#
# **Read along:** `tinyflow/allreduce.py` (`ring_allreduce`, `naive_allreduce`,
# `chunk_bounds`) and the transport interface at the top of
# `tinyflow/transports.py` (`sendrecv`, `ThreadTransport`, `run_threads`).

# %%
import numpy as np

from tinyflow.allreduce import (chunk_bounds, naive_allreduce, ring_allreduce,
                                ring_bytes_per_rank, run_threads)
from tinyflow.backend import set_blas_threads

# One BLAS thread: the lesson's small matrices gain nothing from more, and on a
# busy machine more are much slower (README, "Threads"). 0 = numpy's default.
set_blas_threads(1)

RANKS = 4

# %% [markdown]
# ## 1. Four ranks as threads
#
# An algorithm is written once against a tiny transport interface: `comm.rank`,
# `comm.size`, and `comm.sendrecv(array, dst, out, src)` (send to one rank while
# receiving from another). `ThreadTransport` implements it with queues between
# threads; the same lines run over processes, MPI and NCCL.
#
# `run_threads(4, fn)` calls `fn(comm)` on four threads and returns their results
# in rank order. Each rank starts with its own "gradient": rank r holds
# `[0, 1, ..., 9] + 100 r`.

# %%
def rank_gradient(rank: int, size: int = 10) -> np.ndarray:
    return np.arange(size, dtype=np.float32) + 100 * rank


def ring(comm):
    steps = []                    # ring_allreduce appends one record per step
    result = ring_allreduce(rank_gradient(comm.rank), comm, "sum", record=steps)
    return result, comm.bytes_sent, steps


ring_results = run_threads(RANKS, ring)
expected = sum(rank_gradient(r) for r in range(RANKS))
for rank, (result, sent, _) in enumerate(ring_results):
    print(f"rank {rank}: {result}  sent {sent} bytes")
    assert np.array_equal(result, expected)

# %% [markdown]
# Every rank ends with the same sum, *bitwise*: each chunk is summed once, on one
# rank, then copied to the others. Data parallelism needs that: replicas that
# drifted apart by rounding would train different models.
#
# ## 2. Ring versus naive: bytes sent
#
# Now with a bigger array, 1 MiB of float32 per rank, and both algorithms.

# %%
ELEMENTS = 1 << 18                     # 262,144 float32 = 1 MiB
NBYTES = ELEMENTS * 4


def bytes_sent(algorithm) -> list[int]:
    def body(comm):
        data = np.full(ELEMENTS, comm.rank + 1, dtype=np.float32)
        result = algorithm(data, comm, "sum")
        assert np.all(result == sum(range(1, RANKS + 1)))
        return comm.bytes_sent
    return run_threads(RANKS, body)


ring_bytes, naive_bytes = bytes_sent(ring_allreduce), bytes_sent(naive_allreduce)
print(f"array: {NBYTES / 2**20:.2f} MiB per rank, {RANKS} ranks")
print(f"{'rank':>6}{'ring (MiB)':>14}{'naive (MiB)':>14}")
for rank in range(RANKS):
    print(f"{rank:>6}{ring_bytes[rank] / 2**20:>14.3f}{naive_bytes[rank] / 2**20:>14.3f}")
print(f"{'total':>6}{sum(ring_bytes) / 2**20:>14.3f}{sum(naive_bytes) / 2**20:>14.3f}")
theory = ring_bytes_per_rank(NBYTES, RANKS)
print(f"ring theory: 2(N-1)/N x array = {theory / 2**20:.3f} MiB per rank")
assert all(sent == theory for sent in ring_bytes)           # 1 MiB splits evenly
assert naive_bytes[0] == (RANKS - 1) * NBYTES               # rank 0 is the bottleneck
assert max(ring_bytes) * RANKS == 2 * max(naive_bytes)      # the busiest rank: 2/N as much

# %% [markdown]
# Things to notice:
#
# * In total both algorithms send the same bytes, 2(N-1) arrays. The ring wins by
#   *balance*: every rank sends 1.5 MiB, all at the same time, each to a different
#   neighbour, so no link and no rank is the bottleneck.
# * Naive: rank 0 sends 3 MiB (and receives 3 MiB) while the others send 1 MiB and
#   then wait. With 64 ranks, rank 0 would send 63 arrays; a ring rank still
#   sends fewer than 2.
#
# ## 3. Watching the ring turn
#
# `ring_allreduce(..., record=list)` appends one entry per step: the phase, the
# step, the chunk sent, from which rank to which. The array is cut into N chunks
# (`chunk_bounds`, like `np.array_split`). In **reduce-scatter** (N-1 steps) rank
# r sends chunk r - s to rank r + 1 in step s and adds the chunk it receives into
# its own copy; after N-1 steps rank r holds the finished sum of chunk r + 1. In
# **all-gather** (N-1 more steps) the finished chunks travel around the ring.

# %%
print("chunks of the 10-element array:", chunk_bounds(10, RANKS))
print(f"{'phase':<16}{'step':>5}" + "".join(f"{'rank ' + str(r):>14}" for r in range(RANKS)))
for phase in ("reduce-scatter", "all-gather"):
    for step in range(RANKS - 1):
        cells = []
        for rank in range(RANKS):
            entry = next(e for e in ring_results[rank][2]
                         if e["phase"] == phase and e["step"] == step)
            cells.append(f"c{entry['chunk']} -> r{entry['dst']}")
        print(f"{phase:<16}{step:>5}" + "".join(f"{c:>14}" for c in cells))

# %% [markdown]
# ### Exercise: the ring's schedule, by formula
#
# Check, for every recorded step, the formula from the module docstring: in
# reduce-scatter step s, rank r sends chunk (r - s) mod N to rank (r + 1) mod N;
# in all-gather step s it sends chunk (r + 1 - s) mod N. (Solution filled in; then
# change `RANKS` to 2 or 8 at the top and run again: every check still holds.)

# %%
for rank, (_, _, steps) in enumerate(ring_results):
    assert len(steps) == 2 * (RANKS - 1)
    for entry in steps:
        s = entry["step"]
        want = (rank - s) % RANKS if entry["phase"] == "reduce-scatter" \
            else (rank + 1 - s) % RANKS
        assert entry["chunk"] == want and entry["src"] == rank
        assert entry["dst"] == (rank + 1) % RANKS
print(f"all {RANKS * 2 * (RANKS - 1)} recorded steps follow the formula")

# %% [markdown]
# ## What to remember
#
# * Allreduce gives every rank the sum; the ring makes each rank send
#   2(N-1)/N of the array, independent of N, and every rank works at once.
# * One algorithm, written against `sendrecv`, runs over threads, processes, MPI
#   and NCCL.
# * To train with it: `tinyflow train data_parallel --threads 4` (ranks as
#   threads) or `tinyflow launch -n 4 tutorials/train_data_parallel.py`
#   (processes; MPI when installed). `tinyflow/parallel.py` puts allreduce nodes
#   into the training graph: the gradients are reduced in buckets, on a separate
#   "comm" stream, as soon as the backward pass produces them.
#
# Next: lesson 7 moves the arrays to a GPU.
