"""The committed generated code is what ``python -m protos.build`` makes from the .proto files today."""
import filecmp
import os

from protos import build


def test_generated_code_matches_the_protos(tmp_path):
    written = build.generate(str(tmp_path))
    assert written, "protoc wrote nothing"
    stale = []
    for path in written:
        rel = os.path.relpath(path, tmp_path)
        committed = os.path.join(build.HERE, rel)
        if not os.path.exists(committed) or not filecmp.cmp(path, committed, shallow=False):
            stale.append(rel)
    assert not stale, f"stale generated code, run `python -m protos.build` and commit: {stale}"
