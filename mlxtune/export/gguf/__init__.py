"""GGUF exports, models and adapters (``write``): the metadata each family's file holds
(``hparams``, with the architectures written whole in ``writers``) and what llama.cpp fixes per
architecture, checked before writing (``fixed``). The format itself is ``mlxtune.gguf``."""
