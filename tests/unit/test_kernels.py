"""The one place that chooses the kernels (pdserve.model.kernels) and the one loader class
(pdserve.model.cpp_ext.CppKernel): every branch of the selection with its reason (CPUs and
build states given, so each runs on any machine), the switches as settings, a machine
without a compiler (named, never fatal), and that what the record says is what the engine
runs."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from pdserve.config import SettingsError, load_settings, settings_to_argv
from pdserve.model import amx_linear, avx512_bf16_linear, kernels, pointwise
from pdserve.model.attention import fixed_kernel
from pdserve.model.cpp_ext import CppKernel
from pdserve.model.cpu import CpuFeatures
from pdserve.model.kernel_settings import KernelSettings
from pdserve.model.kernels import select_kernels

BF16, FP32 = torch.bfloat16, torch.float32
SPR = CpuFeatures(avx512=True, avx512_bf16=True, amx=True)  # Xeon with AMX
ZEN4 = CpuFeatures(avx512=True, avx512_bf16=True, amx=False)
SKX = CpuFeatures(avx512=True, avx512_bf16=False, amx=False)  # AVX-512 without BF16
OLD = CpuFeatures(avx512=False, avx512_bf16=False, amx=False)
NO_CXX = "/nonexistent/g++"


def built(kernel: CppKernel, variant: str) -> str | None:
    return None  # every kernel loads


def none_built(kernel: CppKernel, variant: str) -> str | None:
    return f"{kernel.name} kernel ({variant}) not built: no C++ compiler"


def sel(settings: KernelSettings | None = None, dtype=BF16, invariant=True, **kw):
    kw.setdefault("cpu", SPR)
    kw.setdefault("probe", built)
    return select_kernels(settings or KernelSettings(), dtype, "cpu", invariant, **kw)


@pytest.fixture
def fresh_kernels(monkeypatch, tmp_path):
    """An empty build cache and no remembered loads (restored afterwards)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    for k in kernels.ALL:
        k.forget()
    yield tmp_path / "ext"
    for k in kernels.ALL:
        k.forget()


# ---------------------------------------------------------------------------- selection


def test_bf16_on_a_cpu_with_amx_runs_every_kernel():
    s = sel()
    assert s.summary() == "loop=direct attn=kernel/avx512bf16 linear=amx pointwise=fused"
    assert s.reasons() == {
        "loop": "every op of a layer has a compiled kernel",
        "attention": "batch-invariant: the fused C++ kernel",
        "isa": "AVX512-BF16: bf16 dot products",
        "linear": "bf16, batch-invariant on a CPU with AMX",
        "pointwise": "bf16 on AVX-512 (avx512bf16 build)",
    }
    assert s.warning == ""


@pytest.mark.parametrize(
    ("cpu", "summary", "linear_why", "isa_why"),
    [
        (ZEN4, "loop=direct attn=kernel/avx512bf16 linear=avx512bf16 pointwise=fused",
         "bf16, batch-invariant on a CPU with AVX512-BF16 and no AMX",
         "AVX512-BF16: bf16 dot products"),
        (SKX, "loop=module attn=kernel/avx512 linear=onednn pointwise=fused",
         "bf16 without AMX or AVX512-BF16: oneDNN prepacked", "AVX-512 without BF16: fp32 math"),
        (OLD, "loop=module attn=kernel/scalar linear=onednn pointwise=torch",
         "bf16 without AMX or AVX512-BF16: oneDNN prepacked", "no AVX-512 on this CPU"),
    ],
)  # fmt: skip
def test_each_cpu_gets_its_builds(cpu, summary, linear_why, isa_why):
    s = sel(cpu=cpu)
    assert (s.summary(), s.linear_why, s.isa_why) == (summary, linear_why, isa_why)
    if cpu is SKX:
        assert s.loop_why == "no kernel entry for linear=onednn"
    if cpu is OLD:
        assert s.pointwise_why == "no AVX-512 on this CPU"


def test_no_compiler_falls_back_everywhere_and_says_so():
    s = sel(probe=none_built)
    assert s.summary() == "loop=module attn=fixed linear=onednn pointwise=torch"
    assert s.attention_why == "fixed_attn kernel (avx512bf16) not built: no C++ compiler"
    assert s.linear_why.startswith("amx_linear kernel (amx) not built: no C++ compiler; ")
    assert "oneDNN's bf16 is NOT batch-invariant on this CPU" in s.linear_why
    assert s.warning == s.linear_why  # an invariant engine is told it is not
    assert s.pointwise_why == "bf16_pointwise kernel (avx512bf16) not built: no C++ compiler"
    assert s.loop_why == ("no kernel entry for attention=fixed, linear=onednn, pointwise=torch")


def test_fp32_and_batch_variant_engines():
    f = sel(dtype=FP32)
    assert f.summary() == "loop=module attn=kernel/avx512bf16 linear=onednn pointwise=torch"
    assert f.linear_why == "torch.float32: oneDNN prepacked, 1-3 rows padded to 4"
    assert f.pointwise_why == "torch.float32: torch ops (exact against transformers)"
    v = sel(invariant=False)
    assert v.summary() == "loop=module attn=sdpa linear=onednn pointwise=fused"
    assert v.attention_why == "batch-variant (--no-batch-invariant): torch SDPA"
    assert v.linear_why == "batch-variant: oneDNN prepacked bf16" and v.warning == ""


@pytest.mark.parametrize(
    ("switch", "field", "value", "why"),
    [
        ("PDSERVE_ATTN_KERNEL", "attention", "fixed", "PDSERVE_ATTN_KERNEL=off"),
        ("PDSERVE_AMX_LINEAR", "linear", "onednn",
         "PDSERVE_AMX_LINEAR=0: oneDNN's bf16 is NOT batch-invariant on this CPU"),
        ("PDSERVE_BF16_POINTWISE", "pointwise", "torch", "PDSERVE_BF16_POINTWISE=0"),
        ("PDSERVE_DIRECT_LOOP", "loop", "module", "PDSERVE_DIRECT_LOOP=0"),
        ("PDSERVE_PACK_WEIGHTS", "linear", "torch",
         "PDSERVE_PACK_WEIGHTS=0: plain torch linears are NOT batch-invariant"),
    ],
)  # fmt: skip
def test_each_switch_turns_its_kernel_off_and_is_named(switch, field, value, why):
    s = sel(KernelSettings.from_env({switch: "0"}))
    assert (getattr(s, field), getattr(s, f"{field}_why")) == (value, why)
    if field != "loop":
        assert s.loop == "module"
    z = sel(KernelSettings.from_env({"PDSERVE_AVX512_BF16_LINEAR": "0"}), cpu=ZEN4)
    assert z.linear == "onednn" and z.linear_why.startswith("PDSERVE_AVX512_BF16_LINEAR=0: ")


@pytest.mark.parametrize(
    ("setting", "isa", "why"),
    [("scalar", "scalar", "PDSERVE_ATTN_KERNEL=scalar"),
     ("avx512", "avx512", "PDSERVE_ATTN_KERNEL=avx512: fp32 math")],
)  # fmt: skip
def test_the_attention_build_can_be_forced(setting, isa, why):
    asked = []
    s = sel(KernelSettings(attn_kernel=setting), probe=lambda k, v: asked.append((k.name, v)))
    assert (s.attention, s.isa, s.isa_why) == ("kernel", isa, why)
    assert ("fixed_attn", isa) in asked  # the forced build is the one loaded


def test_models_without_a_direct_loop_and_quantized_kv():
    class Qwen3:
        family, qk_norm = "qwen3", True

    class Gemma4:
        family, qk_norm = "gemma4", False

    q = sel(model=Qwen3())
    assert (q.loop, q.loop_why) == ("module", "qwen3: its layers have no direct loop")
    g = sel(model=Gemma4())
    assert (g.loop, g.pointwise, g.pointwise_why) == (
        "module",
        "torch",
        "gemma4: its own layer ops",
    )
    assert sel(kv_quantized=True).attention_why.endswith(
        "; quantized KV layers take the torch fixed path"
    )


def test_an_accelerator_runs_torch_and_names_it():
    s = select_kernels(KernelSettings(), BF16, "cuda", True, cpu=SPR, probe=built)
    assert s.linear == s.pointwise == "torch" and s.loop == "module"
    assert s.attention in ("flashinfer", "fixed")  # fixed: flashinfer is not installed
    assert s.linear_why == "cuda: the C++ kernels are CPU-only"


# ---------------------------------------------------------------------------- settings


def test_switches_are_settings_with_their_env_names(monkeypatch):
    from pdserve.worker.settings import WorkerSettings

    assert KernelSettings.from_env({"PDSERVE_ATTN_KERNEL": "1"}).attn_kernel == "auto"
    assert KernelSettings.from_env({"PDSERVE_ATTN_KERNEL": "0"}).attn_kernel == "off"
    with pytest.raises(SettingsError, match="PDSERVE_ATTN_KERNEL='fast'"):
        KernelSettings.from_env({"PDSERVE_ATTN_KERNEL": "fast"})
    with pytest.raises(SettingsError, match="PDSERVE_AMX_LINEAR='maybe'"):
        KernelSettings.from_env({"PDSERVE_AMX_LINEAR": "maybe"})
    monkeypatch.setenv("PDSERVE_AMX_LINEAR", "0")
    w = load_settings(WorkerSettings, ["--no-direct-loop", "--attn-kernel", "scalar"])
    assert w.kernels == KernelSettings(amx_linear=False, direct_loop=False, attn_kernel="scalar")
    again = load_settings(WorkerSettings, settings_to_argv(w))  # what `pdserve up` passes on
    assert again.kernels == w.kernels


# ---------------------------------------------------------------------------- the loader


def test_a_kernel_without_a_compiler_is_named_and_never_fatal(fresh_kernels, monkeypatch):
    monkeypatch.setenv("CXX", NO_CXX)
    k = pointwise.KERNEL
    st = k.status()
    assert st.module is None and st.state == "missing" and not st.build_broken
    assert st.reason == (
        f"bf16_pointwise kernel ({k.default_variant()}) not built: "
        f"no C++ compiler ({NO_CXX} not found; install g++ or set CXX)"
    )
    if k.default_variant() is None:
        pytest.skip("no variant of the pointwise kernel for this CPU")
    r = k.build()  # never raises, writes nothing
    assert (r.state, r.ok) == ("failed", False) and NO_CXX in r.reason
    assert not k.build_dir(r.variant).exists()
    with pytest.raises(RuntimeError, match=r"not available: .*(not built|no AMX on this CPU)"):
        amx_linear.pack(torch.zeros(16, 32, dtype=BF16))  # a direct use names the reason


def test_stale_failed_and_foreign_builds_are_told_apart(fresh_kernels, monkeypatch):
    monkeypatch.setenv("CXX", sys.executable)  # a binary that exists: "a compiler is here"
    k = fixed_kernel.KERNEL
    d = k.build_dir("scalar")
    d.mkdir(parents=True)
    assert "not built (run `pdserve kernels build --all`)" in str(k.why_unavailable("scalar"))
    (d / "pdserve-build.json").write_text(json.dumps({"stamp": "0" * 16, "error": ""}))
    k.forget()
    assert k.status("scalar").state == "stale"
    stamp = k.stamp("scalar")
    (d / "pdserve-build.json").write_text(json.dumps({"stamp": stamp, "error": "cc1: boom"}))
    k.forget()
    st = k.status("scalar")
    assert (
        st.state == "failed" and st.build_broken and st.reason.endswith("did not build: cc1: boom")
    )
    (d / "pdserve-build.json").write_text(json.dumps({"stamp": stamp, "error": ""}))
    (d / f"{k.module_name('scalar')}.so").write_bytes(b"not an ELF file")
    k.forget()
    st = k.status("scalar")
    assert st.state == "broken" and "cannot be loaded" in str(st.reason)


def test_a_variant_this_cpu_cannot_run_is_never_loaded():
    k = CppKernel(
        "probe", pointwise.KERNEL.source, {"fancy": ["-O3"]},
        cpu_lacks=lambda v: "no FANCY on this CPU",
    )  # fmt: skip
    assert k.default_variant() is None and k.runnable_variants() == []
    assert k.why_unavailable() == "probe kernel: no FANCY on this CPU"
    assert k.build().state == "unsupported"


def test_a_kernel_no_engine_here_serves_is_built_only_by_all(fresh_kernels, monkeypatch):
    """The AVX512-BF16 linear where AMX is: `kernels build` skips it, naming why, `--all`
    builds it, and its missing build points at `--all` (on any CPU: the CPU is patched)."""
    monkeypatch.setenv("CXX", sys.executable)  # "a compiler is here": the hint, not no-compiler
    k = avx512_bf16_linear.KERNEL
    for cpu, served in ((SPR, False), (ZEN4, True)):
        monkeypatch.setattr(CpuFeatures, "detect", staticmethod(lambda cpu=cpu: cpu))
        monkeypatch.setattr(avx512_bf16_linear, "cpu_has_avx512_bf16", lambda: True)
        k.forget()
        assert (k.not_served() is None) == served
        default = dict((t.name, v) for t, v in kernels.build_targets(KernelSettings(), False)
                       if t is k)  # fmt: skip
        assert default == {k.name: "avx512bf16" if served else None}
        assert (k, "avx512bf16") in kernels.build_targets(KernelSettings(), True)
        hint = "(run `pdserve kernels build`)" if served else "(run `pdserve kernels build --all`)"
        assert str(k.why_unavailable()).endswith(f"not built {hint}")
    monkeypatch.setattr(CpuFeatures, "detect", staticmethod(lambda: SPR))
    monkeypatch.setenv("CXX", NO_CXX)  # the others fail at once instead of compiling
    skipped = kernels.build_all(KernelSettings())
    r = next(r for r in skipped if r.kernel == k.name)
    assert (r.state, r.reason) == ("unsupported", avx512_bf16_linear.SERVED_ELSEWHERE)


def test_build_command_without_a_compiler_exits_0_naming_each_fallback(
    fresh_kernels, monkeypatch, capsys
):
    from pdserve.cli.main import main

    monkeypatch.setenv("CXX", NO_CXX)
    assert main(["kernels", "build"]) == 0
    out = capsys.readouterr().out
    amx = CpuFeatures.detect().amx
    for k in kernels.ALL:
        line = next(x for x in out.splitlines() if x.strip().startswith(k.name))
        if k.default_variant() is None or (k is avx512_bf16_linear.KERNEL and amx):
            assert "not used here" in line
        else:
            assert f"falls back to {kernels.FALLBACK[k.name]}: no C++ compiler" in line
    assert "an engine here" in out
    assert main(["kernels", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["compiler"].startswith("none: no C++ compiler") and shown["summary"]


# ---------------------------------------------------------------------------- what runs


@pytest.mark.parametrize(
    ("dtype", "settings"),
    [
        ("bfloat16", KernelSettings()),
        ("bfloat16", KernelSettings(attn_kernel="off", bf16_pointwise=False)),
        ("bfloat16", KernelSettings(pack_weights=False)),
        ("float32", KernelSettings()),
    ],
)
def test_the_record_is_what_the_engine_runs(tmp_path, dtype, settings):
    from pdserve.engine.engine import EngineConfig, LLMEngine
    from pdserve.model.cpu_linear import linear_kind
    from pdserve.model.pointwise import FusedBf16Pointwise
    from pdserve.model.tiny import TinySpec, make_tiny

    path = make_tiny(tmp_path / "m", TinySpec(vocab=512))
    e = LLMEngine(EngineConfig(path, dtype=dtype, num_blocks=16, kernels=settings))
    rec, model = e.kernels, e.runner.model
    assert rec == select_kernels(settings, dtype, "cpu", True, model=model.config)
    assert linear_kind(model) == rec.linear
    assert isinstance(model.pointwise, FusedBf16Pointwise) == (rec.pointwise == "fused")
    assert model.attn_backend.use_kernel == (rec.attention == "kernel")
    assert (model.direct_loop is not None) == (rec.loop == "direct")
    if rec.attention == "kernel":
        assert model.attn_backend.kernel_module() is fixed_kernel.load(rec.isa)
    if rec.linear == "amx":
        assert type(model.layers[0].qkv_proj) is amx_linear.AmxLinear
    if rec.linear == "avx512bf16":
        assert isinstance(model.layers[0].qkv_proj, avx512_bf16_linear.Avx512Bf16Linear)
