"""The Textual dashboard for mlxtune runs, installed as ``mlxtune.tui``.

It reads a run directory (metrics.jsonl, samples.jsonl, checkpoints/) and steers the trainer
through RUN_DIR/control/, so it never shares state with the training thread.
"""
