"""The ``pdserve`` command and its subcommands (the top floor: it may import every other package)."""
