"""``dlo bench``: every method on the same model and inputs in one run, against the measured
limits (:mod:`~dlo.bench.runner`).
"""
