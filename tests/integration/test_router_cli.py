"""`pdserve chat` through a pipe and `pdserve status` against the router process
with fake workers; the router's import graph stays torch-free."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from .router_fakes import FakeWorker, Log, RouterProcess, make_model_dir

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("router-cli-model"))


@pytest.fixture(scope="module")
def router(model_dir):
    proc = RouterProcess(model_dir)
    yield proc
    assert proc.stop() == 0


async def run_cli(*args: str, stdin: str = "") -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pdserve.cli.main",
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin.encode()), 60)
    return proc.returncode, out.decode(), err.decode()


async def test_chat_via_pipe_keeps_history(router):
    log = Log()
    p = await FakeWorker("cli-p", 1, log).start(router.internal_addr)
    d = await FakeWorker("cli-d", 2, log).start(router.internal_addr)
    try:
        rc, out, err = await run_cli(
            "chat",
            "--addr",
            router.addr,
            "--max-tokens",
            "3",
            "--system",
            "Be brief.",
            stdin="hello\nand again\n/exit\nnot sent\n",
        )
    finally:
        await p.stop()
        await d.stop()
    assert rc == 0, err
    assert len(out.splitlines()) == 2  # one streamed reply per turn, then /exit
    assert len(p.prompts) == 2 and len(p.prompts[1]) > len(p.prompts[0])  # history grows
    assert p.prompts[1][: len(p.prompts[0])] == p.prompts[0]  # turn 2 extends turn 1


async def test_chat_reports_errors(router):
    rc, _out, err = await run_cli(
        "chat", "--addr", router.addr, "--max-tokens", "4", stdin="hello\n"
    )
    assert rc == 1 and "Unavailable" in err  # no workers registered


async def test_status_table_and_json(router):
    log = Log()
    p = await FakeWorker("st-p", 1, log).start(router.internal_addr)
    try:
        rc, out, err = await run_cli("status", "--addr", router.addr)
        assert rc == 0, err
        assert "st-p" in out and "prefill" in out and "hit rate" in out
        rc, out, err = await run_cli("status", "--addr", router.addr, "--json")
        assert rc == 0, err
        data = json.loads(out)
        assert [i["role"] for i in data["instances"]] == ["prefill"]
        assert "cache_hit_rate" in data and data["model"]
    finally:
        await p.stop()
    rc, _out, err = await run_cli("status", "--addr", "127.0.0.1:1", "--timeout", "2")
    assert rc == 1 and "cannot reach" in err


def test_router_imports_no_torch(model_dir):
    code = (
        "import sys\n"
        "import pdserve.router.__main__, pdserve.router.app, pdserve.client\n"
        "import pdserve.cli.chat, pdserve.cli.status\n"
        "from pdserve.router.frontdoor.model_info import ModelInfo\n"
        f"m = ModelInfo.from_dir({str(model_dir)!r})\n"
        "assert m.encode('héllo') and m.detokenizer() is not None\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
