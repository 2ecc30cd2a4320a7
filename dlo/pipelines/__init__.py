"""Starting points above the backends: :func:`~dlo.pipelines.load.load_pipeline` builds a
pipeline on ``meta``, fills it from a checkpoint and enables offload.
"""
