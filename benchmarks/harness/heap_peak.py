"""Peak live tensor bytes and heap bytes of a CPU process, every thread included: a malloc
shim built with the C compiler at run time and preloaded into the ranks (see Note [Live heap bytes]).

    lib = build_shim(folder)            # None, with the reason logged, where there is no compiler
    env = preload_env(lib)              # LD_PRELOAD and HEAP_SHIM_ENV for the ranks' environment
    ...                                 # inside a rank:
    heap = HeapPeak.from_env()          # None where the shim was not preloaded
    heap.reset(); step(); heap.tensor_peak(), heap.peak()   # bytes: CPU tensors, the whole heap

Note [Live heap bytes]

Background
    On a GPU ``torch.cuda.max_memory_allocated`` counts every tensor byte. The CPU has no
    such counter: a dispatch-mode or profiler count sees the tensors the dispatcher
    allocates, but Inductor's CPU kernels fill buffers the dispatcher never sees, and the
    optimizer in backward runs on gloo's threads. Resident memory (RSS) is no better: the C
    allocator keeps freed pages, so it shows the most ever held, not what is live. The whole
    heap is no tensor count either: it holds the compiled graphs, guards and Python objects,
    which differ between compiled modes by megabytes.

Algorithm
    - A small shared library defines ``malloc``, ``calloc``, ``realloc``, ``reallocarray``,
      ``free``, ``posix_memalign``, ``aligned_alloc``, ``memalign``, ``valloc`` and
      ``pvalloc`` (glibc's documented set for replacing the allocator) on top of glibc's own
      ``__libc_*`` entry points, and keeps two atomic counters: the live bytes (each block
      counted at its ``malloc_usable_size``, added when made and taken off when freed, so
      both sides agree) and their peak (raised by compare-and-swap).
    - It also defines ``c10::alloc_cpu`` and ``c10::free_cpu``, through which every CPU
      tensor's storage is made and freed (PyTorch's default CPU allocator, and Inductor's
      buffers through it), and counts them apart: live tensor bytes and their peak. libc10
      calls them through its PLT, so the preloaded ones come first; they call libc10's own,
      found in libc10 itself (``dlopen`` with ``RTLD_NOLOAD``: it is loaded local to
      torch, out of ``RTLD_NEXT``'s reach). :meth:`HeapPeak.counts_tensors` checks that a
      tensor made now is seen, for a build that would bypass the PLT.
    - ``LD_PRELOAD`` puts it before libc and libc10 in every process of the job, so every
      thread's allocations pass through it. ``heap_shim_reset`` sets both peaks to the live
      bytes now; ``heap_shim_peak``, ``heap_shim_live``, ``heap_shim_tensor_peak`` and
      ``heap_shim_tensor_live`` read them (``ctypes``).
    - Built with ``cc -O2 -shared -fPIC ... -ldl`` into a folder of the caller's (a fresh private
      one), once per run; without a C compiler :func:`build_shim` returns None and the
      caller records no CPU peak.

Notes
    - The tensor count is what ``max_memory_allocated`` counts on a GPU: every live
      tensor byte, the weights and optimizer state too. The heap count adds everything
      else the process mallocs; memory mapped directly (``mmap`` outside malloc, Python's
      small-object arenas) is in neither.
    - Usable size rounds each block up to the allocator's granule (16 bytes), a few bytes
      per block over the requested size.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch

from .device import peak_bytes, reset_peak
from .report import print0

log = logging.getLogger(__name__)

__all__ = ["SHIM_SOURCE", "HEAP_SHIM_ENV", "build_shim", "preload_env", "HeapPeak", "HeapWindow"]

HEAP_SHIM_ENV = "BENCH_HEAP_SHIM"  # the shim's path, for the ranks to find what LD_PRELOAD loaded

SHIM_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <malloc.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
extern void __libc_free(void *);

static long long live_bytes = 0, peak_bytes = 0;

static void *count_into(long long *live, long long *peak, void *p) {
    if (p) {
        long long now = __atomic_add_fetch(live, (long long)malloc_usable_size(p), __ATOMIC_RELAXED);
        long long seen = __atomic_load_n(peak, __ATOMIC_RELAXED);
        while (now > seen && !__atomic_compare_exchange_n(peak, &seen, now, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
    }
    return p;
}

static void *counted(void *p) { return count_into(&live_bytes, &peak_bytes, p); }

static void uncount(void *p) {
    if (p) __atomic_sub_fetch(&live_bytes, (long long)malloc_usable_size(p), __ATOMIC_RELAXED);
}

void *malloc(size_t n) { return counted(__libc_malloc(n)); }
void *calloc(size_t k, size_t n) { return counted(__libc_calloc(k, n)); }
void free(void *p) { uncount(p); __libc_free(p); }
void *memalign(size_t a, size_t n) { return counted(__libc_memalign(a, n)); }
void *aligned_alloc(size_t a, size_t n) { return counted(__libc_memalign(a, n)); }
void *valloc(size_t n) { return counted(__libc_memalign((size_t)sysconf(_SC_PAGESIZE), n)); }
void *pvalloc(size_t n) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    return counted(__libc_memalign(page, (n + page - 1) / page * page));
}

int posix_memalign(void **out, size_t a, size_t n) {
    if (a % sizeof(void *) || (a & (a - 1))) return EINVAL;
    void *p = __libc_memalign(a, n);
    if (!p && n) return ENOMEM;
    *out = counted(p);
    return 0;
}

void *realloc(void *p, size_t n) {
    if (p && n == 0) { free(p); return 0; }  /* glibc's realloc(p, 0) frees p */
    size_t before = p ? malloc_usable_size(p) : 0;
    void *q = __libc_realloc(p, n);
    if (!q) return 0;  /* failed: p untouched and still counted */
    __atomic_sub_fetch(&live_bytes, (long long)before, __ATOMIC_RELAXED);
    return counted(q);
}

void *reallocarray(void *p, size_t k, size_t n) {
    size_t total;
    if (__builtin_mul_overflow(k, n, &total)) { errno = ENOMEM; return 0; }
    return realloc(p, total);
}

/* PyTorch's CPU tensors: c10::alloc_cpu(size_t) and c10::free_cpu(void*), which libc10 calls through its PLT, so
   the preloaded definitions come first. The real ones are libc10's own: it is loaded by then (it is what calls),
   but with RTLD_LOCAL, out of RTLD_NEXT's reach, so it is opened again by name (RTLD_NOLOAD) and searched. */
static long long tensor_bytes = 0, tensor_peak = 0;
static void *(*real_alloc_cpu)(size_t);
static void (*real_free_cpu)(void *);

static void *c10_symbol(const char *name) {
    void *lib = dlopen("libc10.so", RTLD_LAZY | RTLD_NOLOAD);
    void *sym = lib ? dlsym(lib, name) : 0;
    if (!sym) abort();  /* called from libc10, so it is loaded: never reached */
    return sym;
}

void *_ZN3c109alloc_cpuEm(size_t n) {
    if (!real_alloc_cpu) real_alloc_cpu = (void *(*)(size_t))c10_symbol("_ZN3c109alloc_cpuEm");
    return count_into(&tensor_bytes, &tensor_peak, real_alloc_cpu(n));
}

void _ZN3c108free_cpuEPv(void *p) {
    if (!real_free_cpu) real_free_cpu = (void (*)(void *))c10_symbol("_ZN3c108free_cpuEPv");
    if (p) __atomic_sub_fetch(&tensor_bytes, (long long)malloc_usable_size(p), __ATOMIC_RELAXED);
    real_free_cpu(p);
}

long long heap_shim_live(void) { return __atomic_load_n(&live_bytes, __ATOMIC_RELAXED); }
long long heap_shim_peak(void) { return __atomic_load_n(&peak_bytes, __ATOMIC_RELAXED); }
long long heap_shim_tensor_live(void) { return __atomic_load_n(&tensor_bytes, __ATOMIC_RELAXED); }
long long heap_shim_tensor_peak(void) { return __atomic_load_n(&tensor_peak, __ATOMIC_RELAXED); }
void heap_shim_reset(void) {
    __atomic_store_n(&peak_bytes, __atomic_load_n(&live_bytes, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
    __atomic_store_n(&tensor_peak, __atomic_load_n(&tensor_bytes, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
}
"""


def build_shim(folder: str | Path) -> Path | None:
    """Compile the shim into ``folder`` (which must be the caller's own, e.g. a fresh
    ``tempfile.mkdtemp``); its path, or None (and a warning) where it cannot be built."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        log.warning("no CPU peak memory: no C compiler (cc or gcc) on PATH to build the malloc shim "
                    "(benchmarks/harness/heap_peak.py), so peak_mib is recorded as null; install gcc to measure it")
        return None
    src, lib = Path(folder) / "heap_shim.c", Path(folder) / "heap_shim.so"
    src.write_text(SHIM_SOURCE)
    proc = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(src), "-ldl"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        log.warning("no CPU peak memory: %s could not build the malloc shim (%s), so peak_mib is recorded as null",
                    cc, proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}")
        return None
    return lib


def preload_env(lib: Path | None, env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the shim preloaded, or unchanged for None."""
    out = dict(os.environ if env is None else env)
    if lib is not None:
        out["LD_PRELOAD"] = " ".join(p for p in (str(lib), out.get("LD_PRELOAD", "")) if p)
        out[HEAP_SHIM_ENV] = str(lib)
    return out


class HeapPeak:
    """The preloaded shim's counters, read through ``ctypes`` (Note [Live heap bytes])."""

    def __init__(self, lib: str | Path) -> None:
        self._lib = ctypes.CDLL(str(lib))  # the preloaded copy: dlopen returns the loaded library
        for name in ("heap_shim_live", "heap_shim_peak", "heap_shim_tensor_live", "heap_shim_tensor_peak"):
            getattr(self._lib, name).restype = ctypes.c_longlong
        self._lib.heap_shim_reset.restype = None

    @classmethod
    def from_env(cls) -> HeapPeak | None:
        """The shim this process was started with (``HEAP_SHIM_ENV`` and ``LD_PRELOAD``), or None."""
        lib = os.environ.get(HEAP_SHIM_ENV)
        if not lib or lib not in os.environ.get("LD_PRELOAD", "").split():
            return None
        return cls(lib)

    def live(self) -> int:
        """Heap bytes live now."""
        return int(self._lib.heap_shim_live())

    def peak(self) -> int:
        """The most heap bytes live at once since the last :meth:`reset`."""
        return int(self._lib.heap_shim_peak())

    def tensor_live(self) -> int:
        """Bytes of PyTorch's CPU tensors live now (``c10::alloc_cpu`` less ``c10::free_cpu``)."""
        return int(self._lib.heap_shim_tensor_live())

    def tensor_peak(self) -> int:
        """The most CPU tensor bytes live at once since the last :meth:`reset`."""
        return int(self._lib.heap_shim_tensor_peak())

    def counts_tensors(self) -> bool:
        """Whether this torch's tensors pass through the shim's ``c10::alloc_cpu`` (a libc10 that
        calls it directly, not through its PLT, would bypass it): a 1 MiB tensor is made and looked for."""
        before = self.tensor_live()
        probe = torch.empty(2**20, dtype=torch.uint8)
        seen = self.tensor_live() - before
        del probe
        return seen >= 2**20

    def reset(self) -> None:
        """Start new peak windows (heap and tensor bytes) at the live bytes now."""
        self._lib.heap_shim_reset()


class HeapWindow:
    """Peak-memory windows: ``torch.cuda.max_memory_allocated`` on a GPU; on the CPU the preloaded
    shim's live tensor bytes, its whole heap beside (Note [Live heap bytes]); nothing without either."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        heap = HeapPeak.from_env() if device.type == "cpu" else None
        self.heap = heap if heap is not None and heap.counts_tensors() else None
        if heap is not None and self.heap is None:
            print0(f"no peak memory: torch {torch.__version__}'s CPU tensors bypass the shim's c10::alloc_cpu "
                   "(its libc10 does not call it through the PLT); peak_mib is null")

    @property
    def measures(self) -> bool:
        return self.device.type == "cuda" or self.heap is not None

    def open(self) -> int | None:
        """Start a window; the bytes live at its start."""
        if self.heap is not None:
            self.heap.reset()
            return self.heap.tensor_live()
        reset_peak(self.device)
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else None

    def peak(self) -> int | None:
        return self.heap.tensor_peak() if self.heap is not None else peak_bytes(self.device)

    def heap_peak(self) -> int | None:
        """The window's peak of the whole heap (CPU only): the tensors and all else the process mallocs."""
        return self.heap.peak() if self.heap is not None else None

    def live(self) -> int | None:
        if self.heap is not None:
            return self.heap.tensor_live()
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else None
