"""What every command takes and shows, below the commands: ``flags`` (the one flag set,
generated from the config dataclasses) and ``report`` (the number formats and the tables that
fit 80 columns). ``fived.cli`` (the commands), ``fived.bench`` and ``fived.viz`` import it."""
