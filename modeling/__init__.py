"""What the model-running servers (replica and trainer agents) share about models: the presets.

``presets`` builds tiny, randomly initialised Hugging Face models from a name
and a seed, identically in every process. It imports torch; the controller
and the load balancer never import this package.
"""
