"""The one place that knows about the accelerator and the process environment (ground layer):
:mod:`~dlo.platform.device` (devices, streams, events, host registration),
:mod:`~dlo.platform.env` (``os.environ``, host facts), :mod:`~dlo.platform.timing`.
"""
