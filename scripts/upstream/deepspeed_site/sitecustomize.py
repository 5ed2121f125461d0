"""Every Python process of the DeepSpeed suite (the test processes DeepSpeed's harness spawns too): lazyckpt
injected when $LAZYCKPT_UPSTREAM_MODE=lazy (``lazyckpt_upstream_deepspeed.inject``), once the process imports
``deepspeed`` (an import hook: processes that never import it, such as DeepSpeed's ``cpuinfo`` probe, pay
nothing)."""

import os
import sys

if os.environ.get("LAZYCKPT_UPSTREAM_MODE") == "lazy":
    import importlib.abc
    import importlib.machinery

    class _InjectAfterImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201
            if name != "deepspeed":
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_then_inject(module):  # noqa: ANN001, ANN202
                exec_module(module)
                import lazyckpt_upstream_deepspeed

                lazyckpt_upstream_deepspeed.inject()

            spec.loader.exec_module = exec_then_inject
            return spec

    sys.meta_path.insert(0, _InjectAfterImport())
