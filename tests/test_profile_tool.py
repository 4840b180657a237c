"""scripts/profile_processes.py reads py-spy's collapsed stacks of live processes, torn frames included."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "profile_processes.py"


def _profile_processes():
    spec = importlib.util.spec_from_file_location("profile_processes", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_top_functions_skips_torn_frames_and_counts_the_rest(tmp_path: Path) -> None:
    # A frame py-spy read while the process wrote it: its name runs over a newline, so one line ends without a
    # count and the next holds only the name's tail (seen on the H100 in SGLang's server process).
    raw = tmp_path / "profile-server.txt"
    raw.write_text(
        "main (app.py:1);serve (app.py:9);send (http.py:40) 30\n"
        "main (app.py:1);tokenize (tok.py:3) 10\n"
        'main (app.py:1);spaces_between_special_tokens (smol","choices":[{"delta":{"content":" carpets"}}]}\n'
        "\n"
        "main (app.py:1);serve (app.py:12);send (http.py:41) 20\n"
    )
    report = _profile_processes().top_functions(raw, limit=3)
    assert report["samples"] == 60
    assert report["own"][0] == ("send (http.py)", round(50 / 60, 3))
    assert dict(report["inclusive"])["main (app.py)"] == 1.0
