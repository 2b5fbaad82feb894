"""kvfleet.router."""
