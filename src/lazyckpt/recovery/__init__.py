"""Reading checkpoints back: verification of files, folders and URLs."""
