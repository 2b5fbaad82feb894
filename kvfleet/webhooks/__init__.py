"""kvfleet.webhooks."""
