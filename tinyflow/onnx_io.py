"""ONNX in and out: export a TinyFlow graph as an ONNX model, import one as TinyFlow nodes.

ONNX is how models move between frameworks. These modules are a translator, nothing
more: one table from ONNX operator to registry op (`IMPORTERS`) and one back
(`EXPORTERS`); after `load`, the model is an ordinary TinyFlow graph that the
passes, the memory planner, the executor, autodiff and the debugger handle like
any other. The format is read and written with the `onnx` package (the `onnx`
extra), never by hand; ONNX Runtime is only the oracle of the tests and benchmarks.
The anchors are torch.onnx (export: initializers for weights, symbolic batch
dims), tinygrad's ONNX frontend (import: one small function per operator) and
Netron, which opens the files written here.

    model = tinyflow.onnx_io.load("net.onnx")        # placeholders, outputs, Variables
    sess = model.session()                            # a Session holding the weights
    y = sess.run(model.output, {model.input: x})
    tinyflow.onnx_io.export(logits, [x], "net.onnx", session=sess)

Conventions on the way out: a Variable becomes an initializer (its value read from
the Session), a constant a Constant node, a placeholder a graph input whose `None`
dims are symbolic ("N" for the batch axis); ONNX names keep the TinyFlow node names
and each node's `doc_string` holds the user's file:line. On the way in, every
floating-point initializer becomes a Variable (so an imported model can be
fine-tuned), the rest constants; a node's `where` is "MODEL.onnx:node name" (or its
doc_string, when that is the file:line an export wrote).

Where the code is: `tinyflow/onnx_import.py` holds the import direction (`load`,
`IMPORTERS`) and what both directions share (the errors, `check_opset`, the opsets);
`tinyflow/onnx_export.py` the export direction (`export`, `to_model`, `EXPORTERS`,
`export_record`) and imports from onnx_import, never the reverse. This module is the
public face: it names both, so `tinyflow.onnx_io.load` and `.export` are the calls.
"""

from tinyflow.onnx_export import (
    EXPORTERS,
    after_passes,
    export,
    export_record,
    graph_from_record,
    to_model,
)
from tinyflow.onnx_import import (
    DEFAULT_OPSET,
    ELEMENTWISE,
    IMPORTERS,
    MIN_OPSET,
    OnnxError,
    OnnxModel,
    UnsupportedOpError,
    _onnx,
    check_opset,
    example_feeds,
    load,
    record_model,
)

__all__ = [
    "DEFAULT_OPSET", "ELEMENTWISE", "EXPORTERS", "IMPORTERS", "MIN_OPSET", "OnnxError",
    "OnnxModel", "UnsupportedOpError", "after_passes", "check_opset", "example_feeds",
    "export", "export_record", "graph_from_record", "load", "record_model", "to_model",
    "_onnx",   # (private, but the command line asks it whether the onnx extra is installed)
]
