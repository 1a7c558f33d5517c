"""The JAX backend (``--model-impl jax``): the model's step as one jitted JAX function over
stacked weights and a paged KV cache held in JAX arrays, behind the same engine, scheduler,
block manager, sampler and server as the torch runner.

Nothing here is imported unless that backend is asked for: ``rvllm.jax.runner`` is the
entry point, and importing it imports JAX (the optional ``jax`` extra). Importing this
package first keeps JAX from taking most of a GPU's memory at start (the torch side of
the engine shares the GPU), unless ``XLA_PYTHON_CLIENT_PREALLOCATE`` says otherwise."""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
