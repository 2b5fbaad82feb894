"""Subcommands of the `kvfleet` CLI, one module per area (see kvfleet.cli)."""
