"""The job's process groups, for users: ``dlo.parallel.init(par)`` initializes the default
process group from torchrun's environment (the names here are :mod:`dlo.dist.groups`')."""

from dlo.dist.groups import build_groups, hsdp_mesh, init, shutdown

__all__ = ["build_groups", "hsdp_mesh", "init", "shutdown"]
