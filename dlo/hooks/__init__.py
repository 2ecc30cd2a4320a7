"""Named, owned, removable module hooks (:mod:`~dlo.hooks.registry`), their dispatch
(:mod:`~dlo.hooks.dispatch`), call-frame forensics (:mod:`~dlo.hooks.frames`) and foreign
mechanisms (:mod:`~dlo.hooks.foreign`). The only package that touches ``nn.Module`` hooks.
"""
