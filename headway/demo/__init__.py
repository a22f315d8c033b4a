"""The demo room: the demo target builder (``builder``: a small Llama trained on the stdlib source),
named real targets converted from registry GGUF files (``named``), the ``headway target build``
settings (``configs``, light), and the ``headway demo`` orchestration (``pipeline``)."""
