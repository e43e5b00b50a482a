"""Readers for the images rsccl's kernels compile to, written from the formats, independent
of the Rust loader (so a test of one checks the other): a CUDA fat binary (the
`fatbinary` tool's output, what build.rs embeds) and the ELF cubin inside it (what NVRTC
and ptxas produce). Used by tests/test_kernels_prebuilt.py and scripts/kernel_hashes.py.

Fat binary: a 16-byte header {u32 magic 0xBA55ED50, u16 version, u16 header size, u64 size
of the entries}, then entries, each a header {u16 kind (1 PTX, 2 ELF), u16, u32 header size,
u64 payload size, u32, u32, u16 minor, u16 major, u32 arch (90 = sm_90), ..., u64 flags at
+32} followed by its payload. Flag 0x2000 marks a compressed payload (build.rs asks for none).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import struct
from dataclasses import dataclass

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_ELF = 1, 2
FLAG_COMPRESSED = 0x2000


@dataclass
class Entry:
    kind: int  # KIND_PTX or KIND_ELF
    arch: int  # 90 for sm_90 / compute_90
    flags: int
    payload: bytes

    @property
    def name(self) -> str:
        return f"{'sm' if self.kind == KIND_ELF else 'compute'}_{self.arch}"


def fatbin_entries(data: bytes) -> list[Entry]:
    """Every entry of every fat binary in `data` (the fatbinary tool may write several
    back to back)."""
    out: list[Entry] = []
    pos = 0
    while pos + 16 <= len(data):
        magic, _version, hsize, fat_size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            raise ValueError(f"not a fat binary at offset {pos}: magic {magic:#x}")
        p, end = pos + hsize, pos + hsize + fat_size
        while p < end:
            kind, _u1, ehsize, size = struct.unpack_from("<HHIQ", data, p)
            arch = struct.unpack_from("<I", data, p + 28)[0]
            flags = struct.unpack_from("<Q", data, p + 40)[0]
            if kind not in (KIND_PTX, KIND_ELF) or ehsize < 48:
                raise ValueError(f"bad fat binary entry at offset {p}: kind {kind}, header {ehsize}")
            out.append(Entry(kind, arch, flags, data[p + ehsize : p + ehsize + size]))
            p += ehsize + size
        pos = end
    return out


@dataclass
class Section:
    name: str
    type: int
    data: bytes


def elf_sections(elf: bytes) -> list[Section]:
    """The sections of a 64-bit little-endian ELF (a cubin)."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF")
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    raw = []
    for i in range(shnum):
        name, typ, _flags, _addr, off, size = struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize)
        raw.append((name, typ, off, size))
    _, _, stroff, strsize = raw[shstrndx]
    strtab = elf[stroff : stroff + strsize]

    def cstr(table: bytes, at: int) -> str:
        return table[at : table.index(b"\0", at)].decode()

    # SHT_NOBITS (8) has no bytes in the file.
    return [Section(cstr(strtab, n), t, b"" if t == 8 else elf[o : o + s]) for n, t, o, s in raw]


def kernel_names(elf: bytes) -> set[str]:
    """The entry points (global functions) of a cubin: each has a `.nv.info.<name>`
    section and a `.text.<name>` section; device functions have no `.nv.info.`."""
    names = {s.name for s in elf_sections(elf)}
    return {n.removeprefix(".nv.info.") for n in names if n.startswith(".nv.info.") and ".text." + n.removeprefix(".nv.info.") in names}


def code_hashes(elf: bytes) -> dict[str, str]:
    """sha256 of each function's machine code (`.text.<function>`, kernels and device
    functions alike), and of its constant bank `.nv.constant0.<function>` (the parameters'
    size). Calls between functions are relocations, not yet resolved in a cubin, so a
    function's bytes do not depend on where the others are placed."""
    out = {}
    for s in elf_sections(elf):
        for prefix in (".text.", ".nv.constant0.", ".nv.shared."):
            if s.name.startswith(prefix):
                out[s.name] = hashlib.sha256(s.data).hexdigest() if prefix == ".text." else str(len(s.data))
    return out


# -- NVRTC, through ctypes, as a check that needs no Rust build --------------------------


def load_nvrtc() -> ctypes.CDLL:
    """torch's libnvrtc (nvidia-cuda-nvrtc), with its builtins."""
    import glob

    import nvidia

    for base in nvidia.__path__:
        for d in glob.glob(os.path.join(base, "cu*", "lib")):
            libs = sorted(p for p in glob.glob(os.path.join(d, "libnvrtc.so.*")) if ".alt." not in p)
            builtins = sorted(p for p in glob.glob(os.path.join(d, "libnvrtc-builtins.so.*")) if ".alt." not in p)
            if libs:
                for b in builtins[:1]:
                    ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
                return ctypes.CDLL(libs[0], mode=ctypes.RTLD_GLOBAL)
    raise OSError("libnvrtc not found in the nvidia packages")


def nvrtc_cubin(nvrtc: ctypes.CDLL, source: str, name: str, headers: dict[str, str], options: list[str]) -> bytes:
    """Compile `source` (with `headers`: include name -> text) to a cubin."""
    prog = ctypes.c_void_p()
    hn = list(headers)
    hnames = (ctypes.c_char_p * len(hn))(*[h.encode() for h in hn])
    hsrcs = (ctypes.c_char_p * len(hn))(*[headers[h].encode() for h in hn])
    rc = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), len(hn), hsrcs, hnames)
    if rc:
        raise RuntimeError(f"nvrtcCreateProgram: {rc}")
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        if nvrtc.nvrtcCompileProgram(prog, len(options), opts):
            n = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
            log = ctypes.create_string_buffer(n.value)
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"compiling {name} failed:\n{log.value.decode(errors='replace')}")
        n = ctypes.c_size_t()
        nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(n.value)
        nvrtc.nvrtcGetCUBIN(prog, buf)
        return buf.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
