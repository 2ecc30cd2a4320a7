"""The pure plan: topology (which components and blocks), byte layouts and the manifest, the
layer plan (per-block layouts, slot bytes, budgets), and the automatic policy. No stream,
no process group, no device memory: CPU-only CI tests every decision.
"""
