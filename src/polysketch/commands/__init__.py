"""Subcommands of the ``polysketch`` CLI, one module each (see ``polysketch.cli``)."""
