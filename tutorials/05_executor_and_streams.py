# %% [markdown]
# # Lesson 5: the executor, streams and timelines
#
# A compiled `Program` is a flat list of steps, each a node bound to its kernel
# and to its planned memory. Running it is one loop over the steps. A GPU can do
# better than one loop: it has *streams*, queues that run their kernels in order
# while other streams run theirs, and *events* that let a step on one stream wait
# for a step on another. TinyFlow uses the same model on the CPU, with a worker
# thread per stream, so the same program and the same schedule run on both.
#
# In this lesson you will
#
# 1. record a timeline of a run (`trace=True`);
# 2. put two independent matmul chains on two streams, see whether they overlap,
#    and whether that made the run finish sooner on your machine;
# 3. read the schedule: which step waits for which event, and the vector clocks
#    that prove every input is ready before it is read;
# 4. let check mode (`check_numerics=True`) catch the first NaN, by op and line.
#
# **Read along:** `tinyflow/streams.py` (`assign_streams`, `build_schedule`,
# `validate_schedule`, `CpuStreams`) and, in `tinyflow/executor.py`, `compile`'s
# phases (`_optimize`, `_make_steps`, `_schedule`, `_bind_kernels`, `_plan_memory`,
# `_make_runner`), `Program.run`, the one kernel runner `_execute` and its
# instrumented wrapper `_run_step`; the hardware a program runs on is one `Device`
# of `tinyflow/backend.py`.

# %%
import dataclasses
import os

import numpy as np

import tinyflow as tf
from tinyflow.backend import set_blas_threads
from tinyflow.executor import NumericsError
from tinyflow.streams import ScheduleError, validate_schedule

# One BLAS thread: the lesson's small matrices gain nothing from more, and on a
# busy machine more are much slower (README, "Threads"). 0 = numpy's default.
set_blas_threads(1)

rng = np.random.default_rng(0)

# %% [markdown]
# ## 1. Two independent branches
#
# Each branch is a chain of four `tanh(h @ A)` layers; the branches only meet in
# the final sum. Nothing orders the left chain against the right one.

# %%
N = 512
a = tf.placeholder(tf.float32, (N, N), name="a")
b = tf.placeholder(tf.float32, (N, N), name="b")
left, right = a, b
for _ in range(4):
    left = tf.tanh(tf.matmul(left, a))
    right = tf.tanh(tf.matmul(right, b))
total = tf.reduce_sum(left) + tf.reduce_sum(right)

feeds = {a: ((N, N), np.float32), b: ((N, N), np.float32)}
values = {a: (rng.normal(size=(N, N)) / np.sqrt(N)).astype(np.float32),
          b: (rng.normal(size=(N, N)) / np.sqrt(N)).astype(np.float32)}

# %% [markdown]
# ## 2. A timeline, one stream then two
#
# With `trace=True` every run appends a timeline to `program.timelines`: one event
# per step with its stream, start and end (seconds from the start of the run) and
# the bytes it touched. We run each program a few times (the first run pays for
# warm-up), take the run of median length (one run alone is at the mercy of
# whatever else the machine is doing) and draw it as text, one row per stream.

# %%
def run_ms(timeline: list[dict]) -> float:
    """How long a run took: from its start to the end of its last step, in ms.
    (The times count from the start of the run, so this includes the moment
    before the first step begins, when the steps are handed to the streams.)"""
    return max(e["end"] for e in timeline) * 1e3


def draw(timeline: list[dict], streams: list[str], width: int = 64) -> None:
    """Print one row per stream; '#' where the stream was running a step."""
    end = run_ms(timeline) / 1e3
    for s, name in enumerate(streams):
        row = [" "] * width
        for e in timeline:
            if e["stream"] == s:
                for i in range(int(e["start"] / end * width), int(e["end"] / end * width)):
                    row[min(i, width - 1)] = "#"
        print(f"  {name:>9} |{''.join(row)}|")
    print(f"  {'':>9}  0{'':{width - 10}}{end * 1e3:6.2f} ms")


def busy_together(timeline: list[dict]) -> float:
    """Seconds during which steps of two different streams were running at once."""
    overlap = 0.0
    for i, e in enumerate(timeline):
        for f in timeline[i + 1:]:
            if e["stream"] != f["stream"]:
                overlap += max(0.0, min(e["end"], f["end"]) - max(e["start"], f["start"]))
    return overlap


serial = tf.compile([total], feeds, trace=True)
parallel = tf.compile([total], feeds, streams=2, trace=True)
took, overlap = {}, {}
for program in (serial, parallel):
    for _ in range(6):
        (result,) = program.run(values, {})
    runs = sorted(program.timelines[1:], key=run_ms)       # (the first warmed up)
    timeline = runs[len(runs) // 2]
    streams = len(program.schedule.names)
    took[streams], overlap[streams] = run_ms(timeline), busy_together(timeline) * 1e3
    print(f"\n{streams} stream(s): total = {result:.4f}, run took {took[streams]:.2f} ms "
          f"(median of {len(runs)}), two streams busy at once for {overlap[streams]:.2f} ms")
    draw(timeline, program.schedule.names)

assert np.isclose(serial.run(values, {})[0], parallel.run(values, {})[0], rtol=1e-5)

# %% [markdown]
# Did two streams make the run finish sooner? That depends on your machine, so
# the lesson does not claim it: it compares the two runs above and says what
# they show.

# %%
cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
speedup = took[1] / took[2]
print(f"two streams: {speedup:.2f}x the speed of one ({took[1]:.2f} ms -> {took[2]:.2f} ms), "
      f"{cores} core(s) available to this process")
if speedup >= 1.2:
    print("two streams finished sooner: the two chains really multiplied at once, on "
          "two cores")
elif cores < 2:
    print("this process may use one core only, so the two streams took turns on it: "
          "they cannot finish sooner here")
elif overlap[2] >= 0.5 * took[2]:
    print("the streams overlapped but finished no sooner: each matmul ran slower while "
          "the other ran, so the cores were not free (other work on the machine, two "
          "virtual cores sharing one physical core, or a BLAS already using every core)")
else:
    print("the two streams hardly overlapped: one waited for the other, so there was "
          f"no free core for the second (this process may use {cores})")

# %% [markdown]
# Things to notice:
#
# * Two streams *can* overlap: numpy releases Python's lock (the GIL) inside a
#   matrix product, so two threads can multiply at once on two cores. How much
#   they do depends on your machine and what else it is doing; on a GPU the same
#   schedule runs on CUDA streams.
# * Overlap is not yet speedup: that is why the lesson compares the two run times.
#   Two streams finish sooner only when there are two cores' worth of compute
#   free; on a busy machine, or on two virtual cores that share one physical
#   core, each matmul simply takes twice as long while the other stream runs.
# * If your BLAS library already uses every core for one matmul, two streams
#   compete for the same cores; try `OMP_NUM_THREADS=1 python
#   tutorials/05_executor_and_streams.py` to see the streams alone at work.
#
# ## 3. The schedule: streams, events, vector clocks
#
# `assign_streams` chose a stream per step by list scheduling (each step goes
# where it can start earliest; leaving its producer's stream costs a hand-off).
# `build_schedule` then added the events: a step waits for a producer on another
# stream, unless its *vector clock* shows that producer is already known to be
# done. `clock[k][s]` is the position of the last step on stream `s` that is
# certainly finished when step `k` starts (-1: none).

# %%
schedule = parallel.schedule
names = [step.node.name for step in parallel.steps]
print(f"{'step':>4}  {'node':<12}{'stream':<10}{'waits for':<14}clock")
for k, name in enumerate(names):
    waits = ", ".join(names[w] for w in schedule.waits[k]) or "-"
    print(f"{k:>4}  {name:<12}{schedule.names[schedule.stream_of[k]]:<10}{waits:<14}"
          f"{schedule.clock[k]}")

# %% [markdown]
# The final `add` waits for one event: the end of the other stream's `sum`. It
# need not wait for anything else on that stream: the stream runs in order, so
# that one event covers every earlier step. `happens_before(a, b)` reads the
# clocks; the memory planner uses it to decide which buffers two streams may share.

# %%
last = len(names) - 1
left_steps = [k for k, s in enumerate(schedule.stream_of) if s == schedule.stream_of[0]]
right_steps = [k for k in range(len(names)) if k not in left_steps]
print("step 0 happens before the final add:", schedule.happens_before(0, last))
print("the two first matmuls are ordered:", schedule.happens_before(0, right_steps[0]) or
      schedule.happens_before(right_steps[0], 0))
assert set(schedule.stream_of) == {0, 1}
assert len(schedule.waits[last]) == 1
assert schedule.happens_before(0, last) and schedule.happens_before(right_steps[0], last)
assert not schedule.happens_before(0, right_steps[0])    # free to overlap

# %% [markdown]
# ### Exercise: remove an event
#
# `validate_schedule` recomputes the clocks from the waits alone and proves that
# every input is ready before it is read, so a missing event is an error, never a
# silent race. Remove the final add's wait and see it caught. (Solution filled in;
# then try removing the wait of another step, or compile with `streams=3`.)

# %%
index = {id(step.node): k for k, step in enumerate(parallel.steps)}
deps = [[index[id(i)] for i in step.node.inputs if id(i) in index]
        for step in parallel.steps]
validate_schedule(schedule, deps, names)                    # the real one is fine
broken = dataclasses.replace(schedule, waits=[[] if k == last else w
                                              for k, w in enumerate(schedule.waits)])
try:
    validate_schedule(broken, deps, names)
    raise AssertionError("a missing event went unnoticed")
except ScheduleError as err:
    print("ScheduleError:", err)
    assert names[last] in str(err)

# %% [markdown]
# ## 4. Check mode: the first NaN, named
#
# A NaN in training usually shows up many steps and many ops after it was made.
# `check_numerics=True` checks every step's output as it runs and stops at the
# first NaN or Inf, naming the op, the node and your line. (Check mode switches
# fusion off, so the culprit is one op, not a fused kernel of several.)

# %%
v = tf.placeholder(tf.float32, (4,), name="v")
scores = tf.log(v) * 2.0        # log of a negative number is NaN
answer = tf.reduce_sum(tf.exp(scores))

checked = tf.compile([answer], {v: ((4,), np.float32)}, check_numerics=True)
print("fine input:", checked.run({v: np.array([1, 2, 3, 4], np.float32)}, {})[0])
try:
    checked.run({v: np.array([1, -2, 3, 4], np.float32)}, {})
    raise AssertionError("the NaN went unnoticed")
except NumericsError as err:
    print("NumericsError:", err)
    assert "log" in str(err) and scores.inputs[0].where in str(err)
    assert checked.check_failure["node"] == scores.inputs[0].name

# %% [markdown]
# ## What to remember
#
# * A Program is a list of steps; a stream runs its steps in order; an event
#   orders a step after a step on another stream.
# * Vector clocks make the waits minimal and let `validate_schedule` prove them.
# * `trace=True` records timelines; `check_numerics=True` names the first NaN.
#
# Next: lesson 6 moves data between several workers with ring allreduce.
