"""kvfleet.compat."""
