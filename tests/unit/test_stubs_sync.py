"""The committed stubs in src/pdserve/v1 are exactly what protoc makes from protos/."""

from __future__ import annotations

import shutil
from pathlib import Path

from pdserve.rpc.codegen import PACKAGE_DIR, diff_stubs, generate

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "src" / PACKAGE_DIR


def test_committed_stubs_match_protos(tmp_path: Path) -> None:
    generated = generate(tmp_path, ROOT / "protos")
    assert generated, "protoc produced no stubs"
    problems = diff_stubs(tmp_path / PACKAGE_DIR, COMMITTED)
    assert not problems, (
        "stubs out of date with protos/ (run `python -m pdserve.rpc.codegen`): "
        + ", ".join(problems)
    )


def test_diff_names_the_changed_file(tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(COMMITTED, copy)
    (copy / "router_pb2_grpc.py").write_text("# edited by hand\n")
    (copy / "common_pb2.pyi").unlink()
    problems = diff_stubs(COMMITTED, copy)
    assert problems == ["common_pb2.pyi (missing)", "router_pb2_grpc.py (differs)"]
