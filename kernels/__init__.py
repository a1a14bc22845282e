"""Triton kernels for the GPU verifier, each with a plain PyTorch reference that defines what it computes.

The references live in `references.py`, importable without Triton. Tests run every kernel against its reference
on odd shapes; on a machine without CUDA they run under Triton's interpreter (TRITON_INTERPRET=1, set before
triton is imported).
"""
