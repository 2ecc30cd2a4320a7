"""Configuration: what to offload and how (:mod:`~dlo.config.offload`), the job's parallel
layout (:mod:`~dlo.config.parallel`), the field vocabularies and checks
(:mod:`~dlo.config.fields`).
"""
