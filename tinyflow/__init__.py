"""TinyFlow: a small, complete, readable deep-learning system.

`import tinyflow as tf` gives the TensorFlow-1 style API of the original TinyFlow:
placeholders, Variables, `tf.Session().run`, `tf.gradients`, `tf.train.*Optimizer`,
`tf.nn.*`. The layers underneath, one module each, bottom to top:

    registry.py             OpDef and the registry: every fact about an op
    graph.py                the IR: Node, Graph, topological order
    ops.py, shape_ops.py,   the op registry: compute, gradient, shape/dtype rule and
      nn_ops.py,              flags per op; numpy/CuPy shims
      image_ops.py,
      backend.py
    autodiff.py             reverse-mode gradients as new graph nodes
    rules.py, passes.py,    graph rewrites, each one recorded; the simplification
      fusion.py, gpu.py       rule table; fused kernels (and their CUDA source)
    memory.py, arena.py     the static memory planner (liveness, in place, validator;
                              arena.py: where each block goes)
    sublinear.py            memory-aware order and gradient checkpointing
    streams.py              stream assignment, events, stream runners
    executor.py, session.py compile + run: Program; session.py: TF1's Session
    eager.py, tracing.py,   define-by-run: eager Tensors over the same registry, a
      allocator.py,           tape, tracing into graphs (tf.function), a caching
      eager_record.py         allocator, and an eager run recorded for the debugger
    trace.py, debug.py      the DebugRecord the debugger reads, and recording one
    transports.py,          ring allreduce over threads, processes, MPI, NCCL;
      allreduce.py,           data-parallel training with bucketed allreduce
      parallel.py
    nn.py, optim.py,        layers, optimizers, datasets, checkpoints of Variables
      data.py, saver.py
    cli.py                  the `tinyflow` command (train, debug, export, launch)

The terminal debugger is the separate package `viz/`, which reads DebugRecords;
tinyflow never imports it.
"""

from tinyflow import debug, eager, nn, ops, trace
from tinyflow import optim as train
from tinyflow.api import (Variable, add, add_n, argmax, argmin, assign, assign_add, assign_sub,
                          bool_, clip_by_value, divide, equal, float16, float32, float64,
                          global_variables, global_variables_initializer, gradients, group,
                          infer_variable_shapes, initialize_all_variables, int8, int16, int32,
                          int64, multiply, negative, normal, one_hot, ones, placeholder,
                          random_normal, random_uniform, reduce_max, reduce_mean, reduce_min,
                          reduce_sum, uint8, uint16,
                          reset_default_graph, set_random_seed, square, stack, subtract,
                          trainable_variables, truncated_normal, variables_initializer, zeros)
from tinyflow.executor import Program, compile
from tinyflow.session import InteractiveSession, Session, get_default_session
from tinyflow.tracing import function  # tf.function: trace eager code into a graph
from tinyflow.passes import explain as explain  # tf.explain(program): what the passes did
from tinyflow.errors import ArgumentError
from tinyflow.graph import FeedError, Graph, Node, ShapeError, TinyFlowError
from tinyflow.nn import linear, relu  # the original TinyFlow's top-level names
from tinyflow.shape_ops import pad
from tinyflow.sublinear import checkpoint
from tinyflow.ops import (abs, cast, constant, erf, exp, greater, greater_equal, less, less_equal,
                          log, matmul, maximum, minimum, not_equal, ones_like, pow, sigmoid,
                          sqrt, stop_gradient, tanh, where, zeros_like)
from tinyflow.shape_ops import (broadcast_to, concat, expand_dims, gather, reshape, squeeze,
                                transpose)

from tinyflow.version import VERSION

__version__ = VERSION

bool = bool_  # noqa: A001 - tf.bool, as TF1 spells it

__all__ = [
    "debug", "eager", "function", "nn", "ops", "trace", "train", "Variable", "argmax",
    "assign", "bool", "bool_", "add", "add_n", "assign_add", "assign_sub", "clip_by_value",
    "divide", "multiply", "negative", "one_hot", "square", "stack", "subtract",
    "truncated_normal", "argmin", "reduce_min", "int8", "int16", "uint8", "uint16",
    "equal", "float16", "float32", "float64", "global_variables", "global_variables_initializer",
    "gradients", "group", "infer_variable_shapes", "initialize_all_variables", "int32",
    "int64", "normal", "ones", "placeholder", "random_normal", "random_uniform",
    "reduce_max", "reduce_mean", "reduce_sum", "reset_default_graph", "set_random_seed",
    "trainable_variables", "variables_initializer", "zeros",
    "Program", "Session", "InteractiveSession", "get_default_session", "compile",
    "checkpoint", "linear", "relu", "pad",
    "ArgumentError", "FeedError", "Graph", "Node", "ShapeError",
    "TinyFlowError", "abs", "broadcast_to", "cast", "concat", "constant", "erf", "exp",
    "expand_dims", "gather", "greater", "greater_equal", "less", "less_equal", "log",
    "matmul", "maximum", "minimum", "not_equal", "ones_like", "pow", "reshape",
    "sigmoid", "sqrt", "squeeze", "stop_gradient", "tanh", "transpose", "where",
    "zeros_like",
]

debug.start_from_environment()
