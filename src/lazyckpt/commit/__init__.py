"""How a multi-file checkpoint becomes visible: ``folder`` (pending markers: a folder is complete once
none is left), ``prefix`` (a multi-object checkpoint at a URL prefix: every object, then one key
last), ``remote_folder`` (folder checkpoints at URLs, a manifest last, on ``prefix``).

The other commits live with what they commit, and are found there: a single file's commit (temporary
name, fsync, atomic rename, directory fsync) is the core's committer thread (``core/engine.py``) over
``storage/fs.py``; the distributed two-phase commit (all ranks or none, through the c10d store) is
``distributed/_commit.py`` (its messages and store protocol) and ``distributed/_decide.py`` (the
coordinator's and followers' steps), since it needs torch.distributed and this package does not.
"""
