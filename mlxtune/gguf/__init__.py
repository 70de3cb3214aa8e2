"""GGUF, llama.cpp's format: reading (``file``), tensor names (``names``), tokenizers
(``tokenizer``), writing models and adapters (``export``) and loading a file as a trainable
model (``load``). Import the submodules; this package imports nothing, so that
``mlxtune.models`` and ``mlxtune.gguf.load`` can import each other's pieces."""
