"""GGUF, llama.cpp's format, in both directions: a file's header (``file``), the families' and
tensors' names (``names``), the tensor conventions (``tensors``), the tokenizer (``tokenizer``)
and Llama 3's RoPE factors (``rope``). It imports nothing of mlxtune's but its errors: reading a
file as a model is ``mlxtune.models.gguf``, writing one ``mlxtune.export.gguf``."""
