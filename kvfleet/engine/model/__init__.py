"""kvfleet.engine.model."""
