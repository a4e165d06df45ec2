"""Comparison modules: alternatives measured by the kernelpages protocol from Python.

The Rust runner (`kernelpages::runner`) starts one module per `--compare` name as a server,

    PYTHONPATH=runners python3 -m compare.torch_sdpa serve

sends it one job per (case, implementation) as a JSON line on standard input and reads one
reply per line on standard output. The server measures each job in a fresh process forked
from itself (the framework imported, CUDA never initialised in the server), under the job's
time limit. `protocol` holds the job/reply format, the output check and the server;
`timing` the timing protocol (the same rules and constants as `src/harness.rs`); each library
has its own module (`torch_sdpa`: PyTorch's scaled_dot_product_attention backends), built as
`protocol.main(measure, libraries)`.

Standard library only, apart from the library a module measures.
"""
