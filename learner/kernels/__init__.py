"""Triton kernels (imported lazily: triton is an optional dependency, the ``gpu`` extra).

fused_train.py   one program trains one task end to end (the ``fused`` backend)
"""
