"""Device meshes and the backends that place a model on them."""
