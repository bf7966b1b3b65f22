"""The CPU platform: what this CPU can do, and the paths that make minfer fast on it.

- features.py: the CPU's flags and name (native bf16, AMX, int8 dot products), read from Linux;
- linears.py: which linear each nn.Linear becomes on this CPU: prepacked, or bf16 kept as storage only;
- packing.py: linears and the LM head in oneDNN's prepacked layout;
- tiled_attention.py: the CPU's eager attention backend (context read a tile at a time);
- threads.py, cgroup.py: torch's thread count, from the cores and a container's CPU quota;
- thread_share.py: torch's thread count kept to the cores other processes leave free;
- openmp.py: how OpenMP threads wait, for the banner; malloc.py: glibc's thresholds after a quantizing load.
- huge_pages.py: the weights moved into 2 MB pages, which a step's stream through them reads faster.

The assembly (minfer/assembly/) chooses these from the CPU at hand; the core never imports them.
"""
