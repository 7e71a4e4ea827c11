"""The building blocks every model family is made of: norms, attention over the paged cache,
gated MLPs, sparse MoE MLPs and the decoder layer that arranges them (engine/models)."""
