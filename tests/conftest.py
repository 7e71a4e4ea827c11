"""Shared fixtures: the default model (converted once per machine)."""
