"""Whether rsccl can work on this machine, and what to do where it cannot.

    python -m rsccl.doctor [--json] [--cpu-ok] [--fill-cache [ARCH ...]]

Prints one line per check (ok / missing / error / warn / info / skipped), the GPUs, the
peer-access matrix and `nvidia-smi topo -m`, the RSCCL_* variables and the settings
table, then every problem with a "what to do" line. --json prints the same as one dict.

Exit status, the rule a job's preflight step can rely on:

  0  rsccl's CUDA engine can work here: at least one GPU is visible and every check the
     CUDA engine needs passes (the driver, VMM allocations and POSIX-fd handles on every
     GPU, a compute capability NVRTC targets, peer access between every pair of GPUs,
     NVRTC), and so does what every engine needs (shared memory, valid RSCCL_* settings).
     With --cpu-ok, a machine with no visible GPU also gets 0 when what the CPU engine
     needs passes.
  1  something needed is missing or broken. Without --cpu-ok this includes "no GPU":
     a GPU job whose GPUs are not visible (CUDA_VISIBLE_DEVICES, a container started
     without GPUs) should fail its preflight, not fall back to the CPU.
  2  bad command line.

Warnings (a GPU the prebuilt kernels do not cover and no NVRTC cache for it, a finite RLIMIT_AS) and information (NCCL,
topology, address width) never change the status. No check raises: a library that is
missing or fails is reported as such.
"""

# The checks, the report and the command line live in checks.py, gpu.py and report.py; their
# names stay reachable as rsccl.doctor.<name>, as when the doctor was one module.
from .checks import (
    ERROR,
    FAILED,
    INFO,
    MISSING,
    OK,
    SKIPPED,
    WARN,
    Check,
    Report,
    check_address_space,
    check_host_shared_memory,
    check_kernel_cache,
    check_kernels,
    check_nccl,
    check_rsccl,
    check_settings,
    check_torch,
    kernel_cache_dir,
    relevant_env,
    settings_rows,
)
from .gpu import (
    CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
    CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
    CUDA_ERROR_NO_DEVICE,
    MIN_CC_NVRTC12,
    MIN_CC_NVRTC13,
    Driver,
    check_gpu,
    check_gpu_count,
    check_nvrtc,
    check_nvrtc_vs_driver,
    check_peer_access,
    check_topology,
    describe_gpus,
    load_driver,
    pci_bus_id,
)
from .report import RULE, as_dict, decide, diagnose, fill_cache, main, render

__all__ = [
    "OK",
    "MISSING",
    "ERROR",
    "WARN",
    "INFO",
    "SKIPPED",
    "FAILED",
    "Check",
    "Report",
    "check_rsccl",
    "check_torch",
    "check_host_shared_memory",
    "settings_rows",
    "check_settings",
    "check_nccl",
    "kernel_cache_dir",
    "check_kernels",
    "check_kernel_cache",
    "check_address_space",
    "relevant_env",
    "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
    "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
    "CUDA_ERROR_NO_DEVICE",
    "MIN_CC_NVRTC12",
    "MIN_CC_NVRTC13",
    "Driver",
    "load_driver",
    "check_nvrtc",
    "check_nvrtc_vs_driver",
    "pci_bus_id",
    "describe_gpus",
    "check_gpu_count",
    "check_gpu",
    "check_peer_access",
    "check_topology",
    "fill_cache",
    "diagnose",
    "decide",
    "RULE",
    "as_dict",
    "render",
    "main",
]
