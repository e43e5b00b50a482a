"""The kernels built into the wheel (rust/core/build.rs, nvcc at `pip install` time): every
module's fat binary holds SASS for every required arch and PTX of the newest, and every
entry point the Rust loader looks up is in its module's code for every arch. Read with
tests/kernel_image.py, a parser of its own (not the loader's), so a wrong embed, a missing
arch or a renamed kernel fails here, on the CPU, before any GPU sees the wheel."""

import pytest
import rsccl
from kernel_image import KIND_ELF, KIND_PTX, fatbin_entries, kernel_names

SASS = (80, 90, 100, 120)  # what the issue asks for: A100, H100/H200, B200, RTX 50xx/RTX PRO
PTX = 120  # the newest, JIT-compiled by the driver on GPUs newer than all of them
MODULES = ("all_reduce", "reduce_scatter", "rooted", "all_gather", "all_to_all", "send_recv", "barrier")


def test_the_build_embedded_every_module():
    info = rsccl._rsccl.prebuilt_kernels()
    assert info["nvcc"].startswith("13.0."), f"built with nvcc {info['nvcc']!r}: the wheel pins 13.0 (driver 580)"
    assert sorted(info["modules"]) == sorted(MODULES), info["modules"].keys()
    assert info["targets"] == [f"sm_{a}" for a in SASS] + [f"compute_{PTX}"]


@pytest.mark.parametrize("module", MODULES)
def test_every_arch_and_every_kernel_is_in_the_fat_binary(module):
    image = rsccl._rsccl.prebuilt_image(module)
    assert image, f"no fat binary for {module}: the wheel was built without the prebuilt-kernels feature"
    entries = fatbin_entries(image)
    sass = {e.arch: e for e in entries if e.kind == KIND_ELF}
    ptx = {e.arch for e in entries if e.kind == KIND_PTX}
    assert sorted(sass) == list(SASS), f"{module}: SASS for {sorted(sass)}"
    assert ptx == {PTX}, f"{module}: PTX for {sorted(ptx)}"
    wanted = {name for m, name in rsccl._rsccl.required_kernels() if m == module}
    assert wanted, module
    for arch, e in sass.items():
        have = kernel_names(e.payload)
        assert wanted <= have, f"{module} sm_{arch} lacks {sorted(wanted - have)}"
        # Nothing the loader does not know about: a kernel no call reaches is dead code.
        assert have <= wanted, f"{module} sm_{arch} has kernels nothing looks up: {sorted(have - wanted)}"


def test_the_loader_finds_every_required_kernel_in_some_module():
    required = rsccl._rsccl.required_kernels()
    # 7 reduce families x 5 dtypes (one entry point serves every op, read from the call's
    # descriptor: issue 30; rs_ce_reduce: reduce_scatter on the copy engines;
    # rs_reduce_scatter_ll: the low-latency reduce_scatter) + 10 kernels without a dtype
    # (rs_p2p_signal: send/recv on the copy engines; rs_all_gather_ll).
    assert len(required) == 7 * 5 + 10
    assert ("send_recv", "rs_p2p_signal") in required
    assert ("reduce_scatter", "rs_reduce_scatter_ll_bf16") in required and ("all_gather", "rs_all_gather_ll") in required
    assert ("reduce_scatter", "rs_ce_reduce_bf16") in required
    assert ("all_reduce", "rs_ar_twoshot_bf16") in required and ("rooted", "rs_reduce_root_i64") in required
    assert {m for m, _ in required} == set(MODULES)


def test_coverage_by_compute_capability(monkeypatch):
    monkeypatch.delenv("RSCCL_KERNELS", raising=False)
    src, what, nbytes = rsccl._rsccl.kernel_choice(9, 0)
    assert (src, what) == ("prebuilt", "sm_90 SASS") and nbytes > 1_000_000
    assert rsccl._rsccl.kernel_choice(8, 9)[:2] == ("prebuilt", "sm_80 SASS")  # L40, RTX 4090
    assert rsccl._rsccl.kernel_choice(10, 3)[:2] == ("prebuilt", "sm_100 SASS")  # B300
    assert rsccl._rsccl.kernel_choice(13, 0)[:2] == ("prebuilt", "compute_120 PTX, compiled by the driver at load")
    src, why, _ = rsccl._rsccl.kernel_choice(7, 5)
    assert src == "nvrtc" and "sm_75" in why and "sm_80" in why, why
    monkeypatch.setenv("RSCCL_KERNELS", "prebuilt")
    with pytest.raises(RuntimeError, match="sm_75.*RSCCL_KERNELS=prebuilt"):
        rsccl._rsccl.kernel_choice(7, 5)
    monkeypatch.setenv("RSCCL_KERNELS", "nvrtc")
    assert rsccl._rsccl.kernel_choice(9, 0)[0] == "nvrtc"
    monkeypatch.setenv("RSCCL_KERNELS", "fatbin")
    with pytest.raises(ValueError, match="RSCCL_KERNELS"):
        rsccl._rsccl.kernel_choice(9, 0)
