"""Checkpoints: the safetensors format (:mod:`~dlo.io.checkpoint`) and filling a ``meta``
skeleton from one (:mod:`~dlo.io.materialize`).
"""
