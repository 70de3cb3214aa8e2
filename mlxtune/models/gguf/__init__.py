"""A GGUF file read as a trainable model: its config from the metadata (``configs``, with each
family's own keys in ``settings`` and the architectures read whole in ``whole``), and its tensors
as the model's weights (``load``). The format itself is ``mlxtune.gguf``."""
