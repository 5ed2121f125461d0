"""Multi-file commits: ``folder`` (pending markers), ``prefix`` (objects at a URL, one key last),
``remote_folder`` (folder checkpoints at URLs). Single files: ``core/engine.py`` over ``storage/fs.py``;
distributed: ``distributed/_commit.py``.
"""
