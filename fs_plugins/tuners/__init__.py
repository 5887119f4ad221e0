"""Adapter layers of the plugin's own, laid out like peft's tuners (config / layer / model)."""
