"""Process groups and the exchanges between ranks: the rank layout and weight groups
(:mod:`~dlo.dist.groups`), store exchanges (:mod:`~dlo.dist.store`) and the startup
agreement (:mod:`~dlo.dist.agreement`).
"""
