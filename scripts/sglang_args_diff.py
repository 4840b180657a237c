"""Which of SGLang's settings differ between two engines, read from the `server_args=ServerArgs(...)` line each logs.

SGLang logs its whole configuration at start when it runs at log level info: the server (`gpu_hold.sh server
--log-level info`) in /tmp/sglang-server.log, Conveyor's engine (`"log_level": "info"` in
CONVEYOR_SGLANG_EXTRA_SERVER_ARGS) in the decode worker's log. Two engines meant to be alike should differ only in
ports, paths and the memory share; anything else is a candidate for why one steps slower than the other.
`gpu_goals.sh wait` runs this when both lines are there.

    python scripts/sglang_args_diff.py /tmp/sglang-server.log /tmp/a/bench-vs-sglang-conveyor/decode.log

Fields that differ by nature (ports, host names, random seeds, file paths of this run) are left out unless --all.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

_FIELD = re.compile(r"(?:ServerArgs\(|, )([a-z_][a-z0-9_]*)=")
# Different in any two engines on one machine, and not a reason for a different speed.
_EXPECTED = re.compile(r"port|host|seed|_path$|^model_path$|tokenizer_path|served_model_name|endpoint|url|"
                       r"dist_init_addr|file_storage|log_level|mem_fraction_static")


def server_args(log: Path) -> dict[str, str]:
    """The fields of the last `server_args=ServerArgs(...)` line in `log`, each value as SGLang printed it."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if "server_args=ServerArgs(" in line]
    if not lines:
        raise SystemExit(f"{log}: no server_args=ServerArgs(...) line (does that engine log at info?)")
    text = lines[-1][lines[-1].index("ServerArgs(") :].rstrip()
    text = text[:-1] if text.endswith(")") else text
    marks = list(_FIELD.finditer(text))
    return {mark[1]: text[mark.end() : following.start() if following else len(text)]
            for mark, following in zip(marks, [*marks[1:], None])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("first", type=Path, help="a log with one engine's server_args line")
    parser.add_argument("second", type=Path, help="a log with the other's")
    parser.add_argument("--all", action="store_true", help="list ports, paths and seeds too")
    args = parser.parse_args()

    first, second = server_args(args.first), server_args(args.second)
    differing = [name for name in sorted(first.keys() | second.keys())
                 if first.get(name) != second.get(name) and (args.all or not _EXPECTED.search(name))]
    if not differing:
        print("no setting differs (beyond ports, paths, seeds and the memory share)")
        return
    width = max(len(name) for name in differing)
    for name in differing:
        print(f"{name:<{width}}  {first.get(name, '(absent)')}  |  {second.get(name, '(absent)')}")


if __name__ == "__main__":
    main()
