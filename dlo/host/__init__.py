"""Host storage of streamed blocks: the exact-size pinned region (:mod:`~dlo.host.region`),
shard byte ranges (:mod:`~dlo.host.shards`), filling shards (:mod:`~dlo.host.packer`), the
checkpoint-mapped backing (:mod:`~dlo.host.mapped`) and the node-shared copy
(:mod:`~dlo.host.node_share`). The only package that allocates or pins host memory.
"""

from dlo.host.region import LEDGER

__all__ = ["LEDGER"]
