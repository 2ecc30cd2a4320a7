"""Process groups and the exchanges between ranks: the rank layout and weight groups
(:mod:`~dlo.parallel.groups`), store exchanges (:mod:`~dlo.parallel.store`) and the startup
agreement (:mod:`~dlo.parallel.agreement`).

For users, ``dlo.parallel.init(par)`` initializes the default process group from torchrun's
environment.
"""

from dlo.parallel.groups import build_groups, hsdp_mesh, init, shutdown

__all__ = ["build_groups", "hsdp_mesh", "init", "shutdown"]
