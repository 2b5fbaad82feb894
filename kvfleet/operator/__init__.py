"""kvfleet.operator."""
