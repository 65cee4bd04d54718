"""The dtype actually served is what every surface shows: a worker started with `--dtype auto`
logs the resolved dtype at start-up, registers it, and `pdserve status` (table and JSON) and
`generate --json` (served and in process) name it, next to the checkpoint's own dtype. So do
the kernels its forward pass runs (pdserve.model.kernels): the start-up log (each choice and
its reason), the registration, `pdserve status` and `generate --json` in process."""

from __future__ import annotations

import argparse
import json

import pytest

from .conftest import start_cluster

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def auto_cluster(serving_model_dir, tmp_path_factory):
    c = start_cluster(
        serving_model_dir,
        mode="colocated",
        colocated=1,
        worker_args=["--num-blocks", "256", "--dtype", "auto"],  # over the suite's float32 pin
        log_dir=str(tmp_path_factory.mktemp("dtype-logs")),
    )
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def resolved() -> str:
    """What `auto` means on this machine (bfloat16 on a CPU with AVX512-BF16/AMX)."""
    from pdserve.model.loader import auto_dtype

    return str(auto_dtype("cpu")).removeprefix("torch.")


def _checkpoint_dtype(model_dir) -> str:
    return json.loads((model_dir / "config.json").read_text())["torch_dtype"]


def test_status_names_the_served_dtype(auto_cluster, resolved, serving_model_dir):
    from pdserve.cli.status import format_table
    from pdserve.client import Client

    ckpt = _checkpoint_dtype(serving_model_dir)
    with Client(auto_cluster.addr) as client:
        status = client.status()
    assert status.dtype == resolved != "auto"
    assert [i.dtype for i in status.instances] == [resolved]
    assert status.checkpoint_dtype == ckpt
    table = format_table(status)
    shown = resolved if resolved == ckpt else f"{resolved} (checkpoint: {ckpt})"
    assert f"dtype: {shown}" in table
    assert status.to_dict()["dtype"] == resolved


def test_worker_log_names_the_resolved_dtype(auto_cluster, resolved):
    lines = (auto_cluster.log_dir / "colocated0.log").read_text().splitlines()
    loaded = [json.loads(x) for x in lines if '"worker loaded"' in x]
    assert loaded, "no 'worker loaded' line"
    assert loaded[0]["dtype"] == resolved and loaded[0]["dtype_setting"] == "auto"


def test_status_and_log_name_the_kernels(auto_cluster, resolved, serving_model_dir):
    from pdserve.cli.status import format_table
    from pdserve.client import Client
    from pdserve.model.config import ModelConfig
    from pdserve.model.kernel_settings import KernelSettings
    from pdserve.model.kernels import select_kernels

    config = ModelConfig.from_dir(serving_model_dir)
    want = select_kernels(KernelSettings.from_env(), resolved, "cpu", True, model=config)
    with Client(auto_cluster.addr) as client:
        status = client.status()
    assert [i.kernels for i in status.instances] == [want.summary()]
    assert f"kernels: {want.summary()}" in format_table(status).splitlines()
    assert status.to_dict()["instances"][0]["kernels"] == want.summary()
    lines = [json.loads(x) for x in (auto_cluster.log_dir / "colocated0.log").read_text().splitlines()
             if x.startswith("{")]  # fmt: skip
    chosen = [x for x in lines if x.get("event") == "kernels"]
    assert chosen and chosen[0]["summary"] == want.summary()
    assert {k: chosen[0][k] for k in want.reasons()} == want.reasons()  # every reason, logged
    loaded = [x for x in lines if x.get("event") == "worker loaded"]
    assert loaded[0]["kernels"] == want.summary()


def _args(**kw) -> argparse.Namespace:
    base = dict(
        prompt=None, prompt_ids="1,2,3", max_tokens=3, temperature=0.0, top_p=1.0, top_k=0,
        seed=None, ignore_eos=True, session=None, api_key=None,
    )  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_generate_json_names_the_dtype(auto_cluster, resolved, serving_model_dir):
    from pdserve.cli.generate import run_local, run_remote

    remote = run_remote(_args(addr=auto_cluster.addr))
    assert remote["dtype"] == resolved
    local = run_local(_args(model=str(serving_model_dir), dtype="auto"))
    assert local["dtype"] == resolved
    assert local["kernels"].startswith("loop=")  # what the in-process engine ran
    pinned = run_local(_args(model=str(serving_model_dir), dtype="float32"))
    assert pinned["dtype"] == "float32"
