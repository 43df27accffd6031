"""A peer process for the harness's own tests: ``answers``, ``dies``, ``hangs``, ``never_says_hello`` or ``cannot_start``.

``answers`` echoes each command back with ``"echo"`` and refuses ``"boom"``;
``dies`` exits with code 3 on its first command; ``hangs`` never answers one;
``cannot_start`` says why instead of hello, and exits with code 1.
Each writes a line to stderr first, so an error can quote it.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from kvfsm.harness.peer import say, serve


def main(behaviour: str) -> None:
    print(f"tiny peer: {behaviour}", file=sys.stderr, flush=True)
    if behaviour == "never_says_hello":
        time.sleep(60)
    if behaviour == "cannot_start":
        say({"error": "no model at /nowhere"})
        sys.exit(1)
    say({"hello": behaviour})

    def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        if behaviour == "dies":
            print("tiny peer: dying with 3", file=sys.stderr, flush=True)
            sys.exit(3)
        if behaviour == "hangs":
            time.sleep(60)
        if cmd["op"] == "boom":
            raise ValueError("boom is not a command")
        return {"echo": cmd}

    serve(handle)


if __name__ == "__main__":
    main(sys.argv[1])
