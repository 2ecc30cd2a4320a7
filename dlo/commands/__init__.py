"""The subcommands of ``dlo`` (see :mod:`dlo.cli`): ``dlo run`` (:mod:`~dlo.commands.run`,
the main job), ``dlo save-checkpoint`` (:mod:`~dlo.commands.save`); ``dlo bench`` lives in
:mod:`dlo.bench`. Each module adds its own flags and runs its command."""
