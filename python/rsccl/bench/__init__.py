"""rsccl's benchmark, `python -m rsccl.bench` (see `--help`).

- cli.py: the command line (every flag, the per-device defaults) and the dispatch.
- common.py: what both devices share (collectives, tolerances, sizes, bus factors).
- cpu.py: `--device cpu`, rsccl against gloo.
- cuda/: `--device cuda`, rsccl against NCCL and torch's symmetric memory (its method in
  cuda/__init__.py).
- fsdp.py, fsdp_report.py: the FSDP2 section of the CUDA bench (in the ranks; its report).
- cuda/overlap.py, cuda/overlap_report.py: the overlap section (matmuls against collectives on
  a side stream); cuda/ctas.py: the CTAs each collective kernel takes.
- hier.py: `--device cuda --hier`, hierarchical vs flat on emulated hosts.
"""
