"""kvfleet.api."""
