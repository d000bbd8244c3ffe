"""CPU memory on transparent huge pages, for the tensors a decode step streams through.

With 4 KiB pages, reading a large tensor costs a TLB miss every 4 KiB and the hardware
prefetchers stop at each page boundary; on 2 MiB pages neither happens. Linux gives
anonymous memory huge pages when it is advised to (`madvise` mode, the default of many
distributions) or always; torch's allocator does not advise. Used for the KV pool
(`PagedKVCache`) and the model's weights (`models.loader`).
"""

from __future__ import annotations

import ctypes
import mmap

import torch

HUGE_PAGE = 2 << 20
"""Bytes of a transparent huge page on x86-64 and most Linux arm64 kernels."""


def empty_on_huge_pages(nbytes: int) -> torch.Tensor:
    """`nbytes` of zero-filled CPU memory (uint8) starting at a 2 MiB boundary, advised for
    transparent huge pages; a plain tensor when smaller than a huge page or where the
    platform lacks the advice. Pages are committed when first written, as torch's are.
    """
    if not hasattr(mmap, "MADV_HUGEPAGE") or nbytes < HUGE_PAGE:
        return torch.zeros(nbytes, dtype=torch.uint8)
    # Private: shared anonymous memory is tmpfs, whose huge pages follow another setting.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass  # a kernel built without huge pages (EINVAL): the advice is only a hint
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    # The tensor holds `region` (through its buffer) for as long as it lives.
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=-address % HUGE_PAGE)
