"""Compiled execution: the paths that run a step through torch.compile or CUDA graphs.

- attention.py: the CPU's compiled attention backend (paged decode read in place by one fused loop);
- flex.py: FlexAttention over the block tables, a GPU's attention backend;
- step.py: a decode step's blocks (--compile-decode-step), or the whole forward (--compile-model), compiled;
- cuda_graphs.py: decode steps replayed from CUDA graphs.

The assembly (minfer/assembly/) attaches them; the core's runner calls them at one line.
"""
