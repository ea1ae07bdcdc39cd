"""TinyFlow's version, in a module of its own at the bottom of the import order: the
files TinyFlow writes (checkpoints, DebugRecords, ONNX models) carry it, and the
modules that write them sit below the `tinyflow` package facade that re-exports it."""

VERSION = "0.1.0"
