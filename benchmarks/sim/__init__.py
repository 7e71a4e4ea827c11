"""A small trace-driven simulator for sizing kvtier deployments (docs/scaling.md)."""
