"""Thread primitives below every other package: ``Worker`` (the one background-thread pool) and ``reentry``
(what a signal handler that interrupted lazyckpt may do)."""
