"""LoRA adapters (vLLM's ``--enable-lora``): PEFT checkpoints applied per request on top
of the base model's weights. ``request`` needs no torch (the server's front process
names adapters with it); ``layers`` and ``manager`` are the engine's."""
