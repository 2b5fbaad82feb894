"""kvfleet.engine."""
