"""Run one documentation page's ```python examples in order, in this process (tests/test_docs.py)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.getcwd())  # noqa: E402 (the repository root, for tests.*)


def main(page: str, workdir: str) -> None:
    from tests.docs_scripts.prelude import names
    from tests.test_docs import examples

    blocks = examples(page)
    env = names("\n".join(code for _, code in blocks))
    env["__name__"] = "__main__"
    os.chdir(workdir)
    for line, code in blocks:
        print(f"--- {page}:{line}", flush=True)
        exec(compile(code, f"{page}:{line}", "exec"), env)  # noqa: S102 - the docs' own examples
    print("--- all examples ran", flush=True)
    os._exit(0)  # (gloo and Lightning threads: no finalizers in the way of the exit status)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
