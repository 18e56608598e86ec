"""Compare an image's installed packages with requirements.lock; exit 1 on any difference.

    docker run --rm IMAGE python -m pip list --format=freeze | python3 check_versions.py requirements.lock pip==26.3 prefect-ray-training==0.1.0

Every pin of the lock must be installed at exactly its version, and nothing else may be installed
but the extra ``name==version`` pairs given (pip itself and the project). Standard library only:
it runs with the host's python3 before any virtual environment exists.
"""

from __future__ import annotations

import re
import sys


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(lines) -> dict[str, str]:
    found = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            if not sep:
                raise SystemExit(f"not an exact pin: {line!r}")
            found[canonical(name.strip())] = version.strip()
    return found


def main(argv: list[str]) -> int:
    with open(argv[1]) as lock:
        expected = pins(lock)
    extras = pins(argv[2:])
    installed = pins(sys.stdin)
    wrong = {n: (v, installed.get(n)) for n, v in {**expected, **extras}.items() if installed.get(n) != v}
    unexpected = sorted(set(installed) - set(expected) - set(extras))
    for name, (want, got) in sorted(wrong.items()):
        print(f"  {name}: locked {want}, installed {got}", file=sys.stderr)
    for name in unexpected:
        print(f"  {name}=={installed[name]}: installed, not in the lock", file=sys.stderr)
    if wrong or unexpected:
        print(f"image packages differ from {argv[1]}: {len(wrong)} wrong or missing, {len(unexpected)} extra", file=sys.stderr)
        return 1
    print(f"{len(expected)} locked packages at their locked versions, plus {', '.join(sorted(argv[2:]))}; nothing else")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
