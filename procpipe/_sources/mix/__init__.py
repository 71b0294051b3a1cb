"""The mixture of sources (``procpipe.Mix``): its plan, its kinds, the consumer-side positions and elastic resume."""
